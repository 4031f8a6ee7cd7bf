"""The store's SQL, one module per concern, written once where the dialects agree.

Statements use ``?`` placeholders and the ``Dialect`` fields (``{now}``, ``{greatest}``,
``{skip_locked}``, ``{for_share}``: ``store/connector.py``); a statement the dialects spell differently
is a dict of variants keyed by dialect name, picked with ``Dialect.pick``.

    jobs.py     jobs and tracks
    members.py  the worker registry, live dispatchers, leases and the fence check
    outbox.py   webhook events
    uploads.py  uploads
    quota.py    a key's usage
"""
