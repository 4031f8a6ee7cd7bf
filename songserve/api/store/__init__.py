"""The job store: what a restart, or another dispatcher, needs to go on.

``protocol.py`` is the contract both engines keep; the records themselves are ``jobs/records.py``.
SQLite (one dispatcher, a file in ``STATE_DIR``) and PostgreSQL (several dispatchers, one queue)
are its engines, each in its own room with its migrations.

    protocol.py  the store's interface
    outbox.py    the webhook outbox's records and rules, kept by both engines
    quota.py     a key's quota as the store checks it
    uploads.py   an upload as the store keeps it
    probe.py     is the store answering in time? (read by ``/ready``)
    sqlite/      the SQLite engine
    postgres/    the PostgreSQL engine
"""
