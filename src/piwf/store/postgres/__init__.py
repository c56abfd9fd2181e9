"""The PostgreSQL store: the aggregates of ``piwf.store.sql`` on psycopg connections from a
pool (``db``: placeholders and transactions; ``backend``: the store, its runner and units
of work; ``schema``/``schema_people``/``layout``: the tables; ``hosts``: the lease rows;
``url``: store URLs without secrets)."""
