"""One TLS context for every httpx client the tests make: pass ``verify=TLS``.

httpx builds a TLS context for every client it makes, so for every ``httpx.get`` (certifi's or
``SSL_CERT_FILE``'s CA bundle read and parsed: ~30 ms of CPU), although the tests speak plain HTTP to
servers on the loopback, thousands of times a run (measured: a tenth of the suite's CPU). A context
is safe to share between clients and threads, so the tests build the one a default client would
build (``httpx.create_ssl_context()``, the same trust settings) once, and hand it to each client
through httpx's public ``verify=`` argument. ``tests/unit/test_suite_shape.py`` finds a client made
without it.
"""

from __future__ import annotations

import httpx

TLS = httpx.create_ssl_context()
