"""HTTP plumbing both services share: how an app is served, guarded, answers errors and reads bodies.

Nothing here knows a route of either service; the dispatcher (``songserve.api``) and the worker
(``songserve.worker``) build their apps from these pieces, and the CLI takes only ``keepalive``.

    serving.py    an app under uvicorn: the graceful drain on SIGTERM/SIGINT, the header-read timeout
    keepalive.py  how long our HTTP clients keep an idle connection (below the servers' keep-alive)
    guard.py      ASGI guards: a bearer token and a request-body size limit
    errors.py     the one error body and the one exception → status mapping
    forms.py      request bodies as they arrive: multipart parsed off the event loop within caps, files spooled
"""
