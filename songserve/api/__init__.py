"""The dispatcher: job API, job store, scheduler over the worker pool, artifact store.

Ten rooms (``http/``, ``service/``, ``dispatch/``, ``store/``, ``workers/``, ``results/``, ``webhooks/``,
``jobs/``, ``acestep/``, ``mcp/``; each ``__init__.py`` lists its modules) and six modules:

    compose.py   the composition root: the start-up checks and every part made once (main and tests)
    main.py      the checks, the log, then serving
    loop_lag.py  how late the event loop wakes (``/metrics``, ``/health``)
    settings.py  ``DispatcherSettings``, the dispatcher's one settings object
    metrics.py   Prometheus, read by every room that counts
    lyrics.py    lyrics cleaning, exactly the reference's (both dialects' requests)
"""
