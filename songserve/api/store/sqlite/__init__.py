"""The SQLite engine of the job store: jobs and tracks in one file (WAL) under the state folder.

store.py       ``SqliteStore``: jobs and tracks, composed with the connectors below
outbox.py      ``SqliteOutbox`` (``store.outbox``): the webhook outbox
uploads.py     ``SqliteUploads`` (``store.uploads``): uploads
members.py     ``SqliteMembers`` (``store.members``): the worker registry, presence and leases
conn.py        the connection and its write transaction, shared by the store and its connectors
quota.py       a key's usage, checked in the job insert's transaction
migrations.py  forward-only schema migrations (``PRAGMA user_version``)
check.py       the start-up check: a store that cannot be trusted is never opened quietly
"""
