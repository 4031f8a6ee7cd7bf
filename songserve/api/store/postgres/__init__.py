"""The PostgreSQL engine of the job store: several dispatchers, one queue (``STORE_URL=postgresql://…``).

store.py       ``PgStore``
conn.py        connections: psycopg 3's async pool, one call per statement or transaction
leases.py      the worker registry, live dispatchers and worker leases
outbox.py      the webhook outbox and key usage
uploads.py     uploads
migrations.py  forward-only schema migrations (the same versions as SQLite's)
"""
