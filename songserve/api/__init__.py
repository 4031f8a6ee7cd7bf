"""The dispatcher: job API, job store, scheduler over the worker pool, artifact store.

Ten rooms (``http/``, ``service/``, ``dispatch/``, ``store/``, ``workers/``, ``results/``, ``webhooks/``,
``jobs/``, ``acestep/``, ``mcp/``; each ``__init__.py`` lists its modules) and five modules:

    main.py      start-up checks, then serving
    settings.py  ``DispatcherSettings``, the dispatcher's one settings object
    metrics.py   Prometheus, read by every room that counts
    lyrics.py    lyrics cleaning, exactly the reference's (both dialects' requests)
"""
