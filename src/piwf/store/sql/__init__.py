"""The store's aggregates as SQL: one module of named statements per aggregate, and
``aggregates.py``, the async classes the ``Store`` interface is made of. Written for the
SQLite backend (``piwf.store.sqlite``: the connection, the schema, the group commit), whose
``Database`` they run on; the PostgreSQL backend (issue 20) runs the same modules on its
own connection, the SQL that differs between the two named by the backend."""
