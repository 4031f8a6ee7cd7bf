"""The dispatcher on the wire: its application, its routes (``docs/api.md``), the page and the docs.

Each route validates, calls one method of the part it depends on (``deps.py``: a service of
``service/``, or the read-only readings) and shapes the answer; nothing here decides anything a
client could not also see through another route.

    app.py       the application: its lifespan (``compose.build``), the key middleware (before any body
                 is read), the routes and the page
    deps.py      the part each route depends on (FastAPI ``Depends``)
    routes.py    the routes of ``docs/api.md``
    page.py      the page's files (``songserve/web/``), GET and HEAD
    api_docs.py  ``/docs`` and ``/redoc`` from files served here (no CDN)
    tags.py      the tag catalogue for tag-mode frontends (``GET /tags``, ``tags.json``)
"""
