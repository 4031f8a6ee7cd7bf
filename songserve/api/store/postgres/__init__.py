"""The PostgreSQL engine of the job store: several dispatchers, one queue (``STORE_URL=postgresql://…``).

store.py       ``PgStore``: jobs and tracks, composed with the connectors below
outbox.py      ``PgOutbox`` (``store.outbox``): the webhook outbox
uploads.py     ``PgUploads`` (``store.uploads``): uploads
members.py     ``PgMembers`` (``store.members``): the worker registry, live dispatchers and worker leases
conn.py        connections: psycopg 3's async pools (``PgLanes``), one call per statement or transaction
quota.py       a key's usage, and its quota under an advisory lock per name
migrations.py  forward-only schema migrations (the same versions as SQLite's)
"""
