"""``python -m tests.newer_piwf serve …``: this piwf as the next version would be on
PostgreSQL: its layout one ahead (LAYOUT_VERSION + 1), reached by one more migration (a
table of its own, added as a real migration adds one). Every other part is this piwf's, so
an upgrade of hosts sharing a store — the newer host migrating it while the older ones
serve — is tested with real processes (tests/test_operating_hosts.py)."""

from __future__ import annotations

import sys

from piwf.store.postgres import hosts, layout, schema

NEXT = schema.LAYOUT_VERSION + 1
schema.MIGRATIONS[schema.LAYOUT_VERSION] = "CREATE TABLE next_layout_probe (id BIGINT PRIMARY KEY);"
schema.LAYOUT_VERSION = layout.LAYOUT_VERSION = NEXT
hosts.renew_lease.__defaults__ = (NEXT,)

if __name__ == "__main__":
    from piwf.cli import main

    sys.exit(main())
