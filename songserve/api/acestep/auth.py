"""The API key as ACE-Step takes it: ``ai_token`` in the body, or the ``Authorization`` header.

With ``API_KEY`` set (the same key as our own port's), the POST routes take a truthy ``ai_token``
in the body first (a wrong one fails even beside a right header), else the header; the GET routes
(``/v1/stats``, ``/v1/models``, ``/v1/audio``) only the header. The header is ``Bearer <key>``, or
the bare key (ACE-Step accepts both). The messages are ACE-Step's; every comparison is
constant-time. ``/health`` needs no key. An ``<audio src>`` sends no header, so with a key set a
browser cannot play ``/v1/audio`` files, as with ACE-Step.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

from songserve.api.acestep.failures import AceError
from songserve.api.acestep.params import AUTH_KEY

BEARER = "Bearer "


def _same(given: str, key: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), key.encode("utf-8"))


def _from_header(authorization: str | None) -> str | None:
    if not authorization:
        return None
    return authorization[len(BEARER) :] if authorization.startswith(BEARER) else authorization


def check_body_or_header(key: str, fields: Mapping[str, Any], authorization: str | None) -> None:
    if not key:
        return
    token = fields.get(AUTH_KEY)
    if token:
        if not _same(str(token), key):
            raise AceError(401, "Invalid ai_token")
        return
    given = _from_header(authorization)
    if given is None:
        raise AceError(401, "Missing ai_token or Authorization header")
    if not _same(given, key):
        raise AceError(401, "Invalid API key")


def check_header(key: str, authorization: str | None) -> None:
    if not key:
        return
    given = _from_header(authorization)
    if given is None:
        raise AceError(401, "Missing Authorization header")
    if not _same(given, key):
        raise AceError(401, "Invalid API key")
