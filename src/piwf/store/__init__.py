"""The store: ``piwf.store.api`` is the interface the host depends on (and all it imports
of the store); ``piwf.store.sqlite`` is the SQLite backend, with all its SQL."""
