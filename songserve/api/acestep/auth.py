"""The API keys as ACE-Step takes them: ``ai_token`` in the body, or the ``Authorization`` header.

With keys set (``API_KEY``, ``API_KEYS_FILE``: the same keys as our own port's, ``keys.py``), the POST
routes take a truthy ``ai_token`` in the body first (a wrong one fails even beside a right header),
else the header; the GET routes (``/v1/stats``, ``/v1/models``, ``/v1/audio``) only the header. The
header is ``Bearer <key>``, or the bare key (ACE-Step accepts both). The messages are ACE-Step's;
every comparison is constant-time (``ApiKeys.identify``). The header is checked before the body is
read (``routes.py``): a body that could carry ``ai_token`` is read only up to ``MAX_BODY_BYTES``
without a key in the header, so no one without a key gets a large body read or parsed. ``/health`` needs no key. An ``<audio
src>`` sends no header, so with a key set a browser cannot play ``/v1/audio`` files, as with
ACE-Step. Each check answers the caller (its key's name and limits: ``release_task`` counts its use)
or None when no keys are set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from songserve.api.acestep.failures import AceError
from songserve.api.acestep.params import AUTH_KEY
from songserve.api.service.keys import ApiKeys, Caller

BEARER = "Bearer "


def _identify(keys: ApiKeys, given: str) -> Caller | None:
    return keys.identify(given.encode("utf-8", "surrogatepass"))


def _from_header(authorization: str | None) -> str | None:
    if not authorization:
        return None
    return authorization[len(BEARER) :] if authorization.startswith(BEARER) else authorization


def check_body_or_header(keys: ApiKeys, fields: Mapping[str, Any], authorization: str | None) -> Caller | None:
    if not keys.enabled:
        return None
    token = fields.get(AUTH_KEY)
    if token:
        if (caller := _identify(keys, str(token))) is None:
            raise AceError(401, "Invalid ai_token")
        return caller
    given = _from_header(authorization)
    if given is None:
        raise AceError(401, "Missing ai_token or Authorization header")
    if (caller := _identify(keys, given)) is None:
        raise AceError(401, "Invalid API key")
    return caller


def header_caller(keys: ApiKeys, authorization: str | None) -> Caller | None:
    """The caller the header names (None: no keys set, no header, or not a key), read before any body."""
    given = _from_header(authorization) if keys.enabled else None
    return _identify(keys, given) if given is not None else None


def check_header(keys: ApiKeys, authorization: str | None) -> Caller | None:
    if not keys.enabled:
        return None
    given = _from_header(authorization)
    if given is None:
        raise AceError(401, "Missing Authorization header")
    if (caller := _identify(keys, given)) is None:
        raise AceError(401, "Invalid API key")
    return caller
