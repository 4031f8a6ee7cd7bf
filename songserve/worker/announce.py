"""A worker that registers itself with dispatchers (``ANNOUNCE``), renews, and leaves on shutdown.

Static ``WORKER_URLS`` need a dispatcher restart to add a GPU host; an announcing worker instead
``POST``s ``/workers`` (``WorkerAnnouncement``) to each dispatcher every ``ANNOUNCE_INTERVAL_SEC``
with a TTL of three intervals, so a worker that dies without saying goodbye lapses on its own
while two lost renewals in a row are tolerated. On shutdown it ``DELETE``s ``/workers/{id}`` where it
is joined, so the dispatcher stops routing to it at once instead of after the TTL.

Announcing starts only once this worker answers its own ``/health``: a dispatcher that polls it
right after the registration must find it (``initializing`` while the models load is fine). One
unreachable or refusing dispatcher never blocks the others and never stops the worker: each is
retried with its own back-off, capped at the interval. Each target's state changes are logged once.
The URL rules (``ANNOUNCE``'s targets, the default ``PUBLIC_URL``) are ``songserve/worker/urls.py``, which
the settings share.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import ValidationError

from songserve.schemas import WorkerAnnounced, WorkerAnnouncement

log = logging.getLogger(__name__)

TTL_INTERVALS = 3.0  # a registration outlives two lost renewals
FIRST_BACKOFF_SEC = 0.5
LEAVE_TIMEOUT_SEC = 2.0  # shutdown must not hang on a dispatcher that went away


def ttl_for(interval_sec: float) -> float:
    """The TTL sent: three intervals, within the contract's 1..3600 s."""
    return min(max(TTL_INTERVALS * interval_sec, 1.0), 3600.0)


@dataclass
class Target:
    """One dispatcher and where this worker stands with it."""

    url: str
    state: str = "pending"  # pending → joined | failing; left after shutdown
    worker_id: int | None = None
    expires_in_sec: float | None = None
    last_error: str | None = None
    last_ok_mono: float | None = None
    renewals: int = 0
    backoff_sec: float = field(default=FIRST_BACKOFF_SEC, repr=False)

    def view(self) -> dict[str, Any]:
        ago = None if self.last_ok_mono is None else round(time.monotonic() - self.last_ok_mono, 1)
        return {
            "url": self.url,
            "state": self.state,
            "worker_id": self.worker_id,
            "renewals": self.renewals,
            "last_ok_sec_ago": ago,
            "last_error": self.last_error,
        }


class Announcer:
    """Registers ``public_url`` with every dispatcher in ``targets`` until stopped, then leaves."""

    def __init__(
        self,
        targets: list[str],
        public_url: str,
        token: str,
        interval_sec: float,
        health_url: str,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.public_url = public_url
        self.interval_sec = interval_sec
        self.ttl_sec = ttl_for(interval_sec)
        self.health_url = health_url
        self.targets = [Target(u) for u in targets]
        self._body = WorkerAnnouncement(url=public_url, ttl_sec=self.ttl_sec).model_dump()
        timeout = httpx.Timeout(min(max(interval_sec, 1.0), 10.0))
        self._client = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {token}"}, timeout=timeout, transport=transport
        )
        self._task: asyncio.Task[None] | None = None

    def view(self) -> list[dict[str, Any]]:
        """The targets and their state, for the worker's ``/config``."""
        return [t.view() for t in self.targets]

    def start(self) -> None:
        """Begin in the background (from the lifespan, before uvicorn binds): wait for /health, then announce."""
        log.info(
            "announcing %s to %s every %.1fs (ttl %.1fs)",
            self.public_url,
            ", ".join(t.url for t in self.targets),
            self.interval_sec,
            self.ttl_sec,
        )
        self._task = asyncio.create_task(self._main(), name="announce")

    async def _main(self) -> None:
        await self._wait_until_serving()
        await asyncio.gather(*(self._run(t) for t in self.targets))

    async def _wait_until_serving(self) -> None:
        """Poll our own /health until it answers: uvicorn binds only after the lifespan started us.

        Its own client without proxy settings from the environment: a loopback call must not go to a proxy.
        """
        delay = 0.05
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as local:
            while True:
                try:
                    if (await local.get(self.health_url)).status_code < 500:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _run(self, t: Target) -> None:
        """One dispatcher, forever: renew every interval while joined, back off while failing."""
        while True:
            try:
                ok = await self._announce(t)
            except Exception:  # a bug here must not end announcing for good: log it, back off, go on
                log.exception("announce %s: unexpected error", t.url)
                ok = False
            if ok:
                t.backoff_sec = FIRST_BACKOFF_SEC
                await asyncio.sleep(self.interval_sec)
            else:
                await asyncio.sleep(min(t.backoff_sec, self.interval_sec))
                t.backoff_sec = min(t.backoff_sec * 2, self.interval_sec)

    async def _announce(self, t: Target) -> bool:
        """One POST /workers; updates ``t`` and logs a change of state (or of worker id) once."""
        error: str | None = None
        answer: WorkerAnnounced | None = None
        try:
            r = await self._client.post(t.url + "/workers", json=self._body)
            if r.status_code == 200:
                answer = WorkerAnnounced.model_validate(r.json())
            else:
                error = f"HTTP {r.status_code}: {_error_text(r)}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except (ValueError, ValidationError) as exc:
            error = f"unexpected answer: {str(exc).splitlines()[0]}"
        if answer is not None:
            if t.state != "joined" or t.worker_id != answer.worker_id:
                log.info(
                    "announce %s: joined as worker %d (%s, ttl %.1fs)",
                    t.url,
                    answer.worker_id,
                    self.public_url,
                    self.ttl_sec,
                )
            t.state, t.worker_id, t.expires_in_sec, t.last_error = (
                "joined",
                answer.worker_id,
                answer.expires_in_sec,
                None,
            )
            t.last_ok_mono = time.monotonic()
            t.renewals += 1
            return True
        if t.state != "failing" or t.last_error != error:
            log.warning(
                "announce %s: failing (worker %s): %s; retrying with back-off up to %.1fs",
                t.url,
                t.worker_id if t.worker_id is not None else "-",
                error,
                self.interval_sec,
            )
        t.state, t.last_error = "failing", error
        return False

    async def stop(self) -> None:
        """Stop renewing, then leave every dispatcher where this worker is joined (short timeout each)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        # failing after a join: the registration may not have lapsed yet, so leave there too
        joined = [t for t in self.targets if t.worker_id is not None and t.state in ("joined", "failing")]
        await asyncio.gather(*(self._leave(t) for t in joined))
        await self._client.aclose()

    async def _leave(self, t: Target) -> None:
        try:
            r = await self._client.delete(f"{t.url}/workers/{t.worker_id}", timeout=LEAVE_TIMEOUT_SEC)
        except httpx.HTTPError as exc:
            log.warning("announce %s: could not leave as worker %s (%s); it lapses by ttl", t.url, t.worker_id, exc)
            return
        if r.status_code in (200, 404):  # 404: it had already lapsed or the dispatcher restarted
            log.info("announce %s: left as worker %s", t.url, t.worker_id)
            t.state = "left"
        else:
            log.warning("announce %s: leaving as worker %s got HTTP %d", t.url, t.worker_id, r.status_code)


def _error_text(r: httpx.Response) -> str:
    """The error body's one sentence (api.md), else the start of the body."""
    try:
        body = r.json()
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, str):
            return error[:200]
    except ValueError:
        pass
    return r.text[:200].replace("\n", " ")
