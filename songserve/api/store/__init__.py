"""The job store: what a restart, or another dispatcher, needs to go on.

Written once, over one narrow connector per engine: ``Store`` (``jobs.py``) keeps the jobs and tracks
and composes one repository per other concern on the same connector, reached as its attributes
(``store.outbox``, ``store.uploads``, ``store.members``), each with its protocol beside its records.
The SQL is in ``queries/``, one module per concern, shared where the dialects agree. SQLite (one
dispatcher, a file in ``STATE_DIR``, its connection on a thread of its own) and PostgreSQL (several
dispatchers, one queue) are the engines, each in its own room: its connector, its schema steps, and
its store, which only opens the connector and migrates it.

    protocol.py    the store's interface (``JobStore``) and the rules both engines keep
    connector.py   the connector's interface (``Connector``, ``Tx``) and the ``Dialect`` differences
    jobs.py        ``Store``: jobs and tracks, usage, events and exclusive work, over a connector
    outbox.py      the webhook outbox's records and rules, ``Outbox`` and its repository
    uploads.py     an upload as the store keeps it, ``UploadStore`` and its repository
    members.py     the worker registry, presence and leases (``MemberStore``, ``Fence``, ``holds``)
    quota.py       a key's quota as the store checks it
    queries/       the SQL, one module per concern
    migrations.py  the one migration runner (a step, the refusal of a newer schema, the log line)
    probe.py       is the store answering in time? (read by ``/ready``)
    sqlite/        the SQLite engine
    postgres/      the PostgreSQL engine
"""
