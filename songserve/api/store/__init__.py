"""The job store: what a restart, or another dispatcher, needs to go on.

``protocol.py`` is the contract both engines keep; the records themselves are ``jobs/records.py``.
SQLite (one dispatcher, a file in ``STATE_DIR``) and PostgreSQL (several dispatchers, one queue)
are its engines, each in its own room with its migrations. An engine is a jobs-and-tracks store
composed with one small connector per other concern, reached as its attributes (``store.outbox``,
``store.uploads``, ``store.members``), each with its own protocol: no engine is a stack of mixins.

    protocol.py    the store's interface (``JobStore``: jobs, tracks, usage, events, exclusive work)
    outbox.py      the webhook outbox's records and rules, and its connector's protocol (``Outbox``)
    uploads.py     an upload as the store keeps it, and its connector's protocol (``UploadStore``)
    members.py     the worker registry, presence and leases (``MemberStore``, ``Fence``)
    quota.py       a key's quota as the store checks it
    migrations.py  what both engines' migrations share
    probe.py       is the store answering in time? (read by ``/ready``)
    sqlite/        the SQLite engine
    postgres/      the PostgreSQL engine
"""
