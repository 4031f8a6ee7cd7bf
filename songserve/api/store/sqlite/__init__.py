"""The SQLite engine of the job store: jobs and tracks in one file (WAL) under the state folder.

store.py       ``SqliteStore``
outbox.py      the webhook outbox and key usage
uploads.py     uploads
migrations.py  forward-only schema migrations (``PRAGMA user_version``)
check.py       the start-up check: a store that cannot be trusted is never opened quietly
"""
