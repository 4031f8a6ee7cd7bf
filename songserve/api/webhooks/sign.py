"""Webhook signatures as the Standard Webhooks specification has them (standardwebhooks.com).

Each try of an event carries three headers: ``webhook-id`` (the event's id, the same on every try,
so a receiver can drop repeats), ``webhook-timestamp`` (seconds since the epoch, when this try was
sent, so a receiver can refuse old replays) and ``webhook-signature``: ``v1,`` and the base64 of
HMAC-SHA256 over ``"{id}.{timestamp}.{body}"`` with the secret's bytes. The secret
(``WEBHOOK_SECRET``) is the spec's form, ``whsec_`` and the base64 of the key's bytes (what its
libraries generate and read), or any other text, whose UTF-8 bytes are then the key. ``verify`` is
what a receiver does (docs/integrations.md has the same in a dozen lines of the standard library).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Mapping

PREFIX = "whsec_"
TOLERANCE_SEC = 300  # a receiver refuses a try whose timestamp is further than this from its clock


def signing_key(secret: str) -> bytes:
    """The HMAC key of a ``WEBHOOK_SECRET``; raises ``ValueError`` for a ``whsec_`` secret that is not base64."""
    if not secret.startswith(PREFIX):
        return secret.encode()
    try:
        key = base64.b64decode(secret[len(PREFIX) :], validate=True)
    except binascii.Error:
        raise ValueError("a whsec_ secret must be followed by base64 (the key's bytes)") from None
    if not key:
        raise ValueError("a whsec_ secret must hold a key")
    return key


def signature(key: bytes, event_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value of one try: ``v1,<base64 HMAC-SHA256>``."""
    mac = hmac.new(key, f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def headers(key: bytes, event_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """The three headers of a try sent now."""
    ts = int(time.time() if now is None else now)
    return {
        "webhook-id": event_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": signature(key, event_id, ts, body),
    }


def verify(secret: str, got: Mapping[str, str], body: bytes, now: float | None = None) -> bool:
    """A receiver's check: a ``v1`` signature of the headers' id and timestamp matches, and the
    timestamp is within five minutes of ``now``. ``got``'s names in lower case."""
    try:
        event_id, ts = got["webhook-id"], int(got["webhook-timestamp"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - ts) > TOLERANCE_SEC:
        return False
    want = signature(signing_key(secret), event_id, ts, body).encode()
    # Several signatures may be sent (space-separated) while a secret is rotated; any one matching will do.
    return any(hmac.compare_digest(want, s.encode()) for s in got.get("webhook-signature", "").split())
