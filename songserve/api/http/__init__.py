"""The dispatcher on the wire: its application, its routes (``docs/api.md``), the page and the docs.

Each route validates, calls one ``JobService`` method (``service/``) and shapes the answer; nothing
here decides anything a client could not also see through another route.

    app.py       the application: the service's lifespan, the key middleware (before any body is read),
                 the routes and the page
    routes.py    the routes of ``docs/api.md``
    page.py      the page's files (``songserve/web/``), GET and HEAD
    api_docs.py  ``/docs`` and ``/redoc`` from files served here (no CDN)
    tags.py      the tag catalogue for tag-mode frontends (``GET /tags``, ``tags.json``)
"""
