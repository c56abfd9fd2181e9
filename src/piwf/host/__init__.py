"""The supervisor: nursery tree, socket server, operations, run supervision."""
