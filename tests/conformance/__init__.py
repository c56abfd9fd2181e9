"""The store's conformance suite: the store's behaviour, written once against the interface
(``piwf.store.api``) and run against every backend in ``backends.BACKENDS``.

- Tests use only the ``store`` fixture (and ``open_store`` for a second store on the same
  database, as another host would see it), never a backend module, SQL or a ``Database``:
  the fixture's Recording refuses any attribute the interface does not declare.
- ``test_interface_coverage.py`` runs last and fails when a method of an interface
  Protocol was called by no test (when the whole suite was selected).
- Adding a backend: a class like ``backends.SqliteBackend`` (open a store on the test's
  database, close it) and one entry in ``BACKENDS``. Where the interface says backends
  differ (the host lease's shape, the clock), the tests of the SQLite shape are in
  ``test_hosts.py``; a backend of another shape adds its own there.
- Backend-only behaviour (SQLite's counting triggers, query plans, migrations) is tested
  outside this package (tests/test_store_sqlite.py, tests/test_store_layout.py).
"""
