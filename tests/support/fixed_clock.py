"""A store whose ``now()`` is a value the test sets, for the schedules' tests."""

from __future__ import annotations

import datetime as dt

from cyclone_mp.store import Store, connect


class FixedClock:
    """A connection whose now() is a value the test sets: a function now() in a schema that
    comes before pg_catalog on its search_path (the tables stay in public)."""

    def __init__(self, dsn: str):
        admin = connect(dsn)
        admin.execute("CREATE SCHEMA IF NOT EXISTS fakeclock")
        admin.execute("CREATE OR REPLACE FUNCTION fakeclock.now() RETURNS timestamptz LANGUAGE sql STABLE"
                      " AS $$ SELECT current_setting('cyclone.test_now')::timestamptz $$")
        admin.close()
        self.store = Store.open(dsn)
        self.store.conn.execute("SET search_path = fakeclock, public, pg_catalog")

    def at(self, when: dt.datetime) -> Store:
        self.store.conn.execute("SELECT set_config('cyclone.test_now', %s, false)", (when.isoformat(),))
        return self.store
