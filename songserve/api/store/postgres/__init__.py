"""The PostgreSQL engine of the job store: several dispatchers, one queue (``STORE_URL=postgresql://…``).

conn.py        psycopg 3's async pools (``PgLanes``), their time limits, what a dead connection means
connector.py   ``PgConnector``: the narrow connector over the pools; ``NOTIFY``/``LISTEN``, advisory locks
store.py       ``PgStore``: the store (``store/jobs.py``) over that connector, migrated at open
migrations.py  the schema steps in PostgreSQL's SQL (the same versions as SQLite's)
"""
