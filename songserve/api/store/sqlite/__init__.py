"""The SQLite engine of the job store: jobs and tracks in one file (WAL) under the state folder.

connector.py   ``SqliteConnector``: one connection owned by one thread, calls awaited through it
store.py       ``SqliteStore``: the store (``store/jobs.py``) over that connector, migrated at open
migrations.py  the schema steps in SQLite's SQL (``PRAGMA user_version``)
check.py       the start-up check: a store that cannot be trusted is never opened quietly
"""
