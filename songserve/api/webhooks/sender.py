"""The ``webhooks`` loop: claims due events from the outbox and sends them, signed, never blocking a job.

Each step waits for a kick (a new event, a finished try) or half a second, claims what is due up to
``MAX_SENDING`` at a time (leased for the receiver's timeout and a margin: a dispatcher that dies
mid-try leaves a lease that lapses, and the event is claimed again, by whoever is alive), and sends
each in a task of its own, so one slow receiver holds up its own job's events only. A try is one
POST of the stored body with the Standard Webhooks headers (``webhooks/sign.py``) to the address
``WEBHOOK_ALLOW`` admitted just now (``webhooks/targets.py``), no redirect followed, its whole answer
within ``WEBHOOK_TIMEOUT_SEC``, its body never read. A 2xx is delivered; anything else is a failure,
tried again after ``retry_delay`` until the event is ``WEBHOOK_MAX_AGE_SEC`` old, then given up.
The store's outcome of a try failing is logged: the lease lapses and the event is tried again (at
least once). A job's state never waits for any of this: the events were written with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from urllib.parse import urlsplit

import httpx

from songserve import __version__
from songserve.api.metrics import DispatcherMetrics
from songserve.api.settings import DispatcherSettings
from songserve.api.store.outbox import SWEEP_AFTER_SEC, Delivery, OutboxStats, retry_delay
from songserve.api.store.protocol import JobStore, StoreError
from songserve.api.webhooks.events import JobEvents
from songserve.api.webhooks.sign import headers, signing_key
from songserve.api.webhooks.targets import Refused, WebhookPolicy

log = logging.getLogger(__name__)
POLL_SEC = 0.5  # how soon another dispatcher's events (or a retry coming due) are seen
MAX_SENDING = 16  # tries in flight at once
LEASE_MARGIN_SEC = 30.0  # a claim outlives the receiver's timeout by this (the store's write after it)
STATS_SEC = 1.0  # the outbox's depth and oldest event, read at most this often (for /metrics)
SWEEP_SEC = 60.0  # delivered and given-up rows are swept at most this often


class WebhookSender:
    def __init__(
        self, s: DispatcherSettings, store: JobStore, me: str, metrics: DispatcherMetrics, events: JobEvents
    ) -> None:
        self.s, self.store, self.me, self.metrics = s, store, me, metrics
        self.key = signing_key(s.webhook_secret) if s.webhook_secret else None
        self.policy = WebhookPolicy(s.webhook_allow)
        # Its own client: never the workers' (which sends the worker token), no proxy from the environment.
        self.http = httpx.AsyncClient(
            follow_redirects=False,
            trust_env=False,
            timeout=httpx.Timeout(s.webhook_timeout_sec),
            limits=httpx.Limits(max_connections=MAX_SENDING, max_keepalive_connections=MAX_SENDING),
        )
        self.stats = OutboxStats()
        self._kick = events.new  # set for each event written here, and when a try ends
        self._sending: dict[int, asyncio.Task[None]] = {}
        self._stats_at = self._swept_at = 0.0
        metrics.watch_outbox(lambda: self.stats)

    async def start(self) -> None:
        """This dispatcher (re)starts: whatever it was sending before is not being sent any more."""
        await self.store.outbox.release(self.me)

    async def stop(self) -> None:
        tasks = list(self._sending.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.http.aclose()

    async def step(self) -> None:
        """One turn of the loop: wait, claim and start what is due, refresh the numbers, sweep."""
        # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that meets a set event
        # (this event is set often), and the loop would then outlive the dispatcher's stop.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(POLL_SEC):
                await self._kick.wait()
        self._kick.clear()
        room = MAX_SENDING - len(self._sending)
        if room > 0 and self.key is not None:  # without a secret: another dispatcher of the fleet sends them
            for d in await self.store.outbox.claim(self.me, room, self.s.webhook_timeout_sec + LEASE_MARGIN_SEC):
                self._sending[d.row] = asyncio.create_task(self._deliver(d), name=f"webhook-{d.row}")
        now = time.monotonic()
        if now - self._stats_at >= STATS_SEC:
            self._stats_at = now
            self.stats = await self.store.outbox.stats()
        if now - self._swept_at >= SWEEP_SEC:
            self._swept_at = now
            await self.store.outbox.sweep(time.time() - SWEEP_AFTER_SEC)

    async def _deliver(self, d: Delivery) -> None:
        e, host = d.event, urlsplit(d.event.url).hostname  # the URL's path and query may hold a token: not logged
        try:
            failure = await self._send(d)
            if failure is None:
                await self.store.outbox.delivered(d.row)
                self.metrics.webhook_delivered.labels(e.kind).inc()
                log.info(
                    "job %s: webhook %s (%s) delivered to %s (try %d)",
                    e.job_id,
                    e.event_id,
                    e.kind,
                    host,
                    d.attempts + 1,
                )
                return
            reason, why = failure
            self.metrics.webhook_failures.labels(reason).inc()
            old = time.time() - e.created_at >= self.s.webhook_max_age_sec
            retry = None if old else retry_delay(d.attempts + 1, self.s.webhook_retry_base_sec)
            await self.store.outbox.failed(d.row, self.me, why, retry)
            if retry is None:
                self.metrics.webhook_given_up.inc()
                log.warning(
                    "job %s: webhook %s (%s) to %s given up after %d tries: %s",
                    e.job_id,
                    e.event_id,
                    e.kind,
                    host,
                    d.attempts + 1,
                    why,
                )
            else:
                log.info(
                    "job %s: webhook %s (%s) to %s failed (%s); again in %.1fs",
                    e.job_id,
                    e.event_id,
                    e.kind,
                    host,
                    why,
                    retry,
                )
        except StoreError as exc:
            log.warning(
                "job %s: webhook %s: its outcome not stored (%s); tried again when its claim lapses",
                e.job_id,
                e.event_id,
                exc,
            )
        except Exception:
            log.exception("job %s: webhook %s: internal error; tried again when its claim lapses", e.job_id, e.event_id)
        finally:
            self._sending.pop(d.row, None)
            self._kick.set()

    async def _send(self, d: Delivery) -> tuple[str, str] | None:
        """One try: None when the receiver answered 2xx, else (a metrics reason, a sentence)."""
        e, timeout = d.event, self.s.webhook_timeout_sec
        assert self.key is not None  # claimed only with a secret
        try:
            target = await self.policy.check(e.url)  # again now: the name may point elsewhere since the submit
        except Refused as exc:
            return "refused", f"refused: {exc}"
        body = e.body.encode()
        sent = {
            "content-type": "application/json",
            "user-agent": f"songserve/{__version__}",
            "host": target.host,
            **headers(self.key, e.event_id, body),
        }
        request = self.http.build_request(
            "POST",
            target.url,
            content=body,
            headers=sent,
            extensions={"sni_hostname": target.sni} if target.sni else {},
        )
        try:
            async with asyncio.timeout(timeout):  # the whole answer, however slowly it trickles
                response = await self.http.send(request, stream=True)
                await response.aclose()  # its body is not read
        except TimeoutError:
            return "timeout", f"no answer within {timeout:g}s"
        except httpx.HTTPError as exc:
            return "connect", f"{type(exc).__name__}: {exc}"[:300]
        if response.is_success:
            return None
        if response.is_redirect:
            return "status", f"answered {response.status_code} (redirects are not followed)"
        return "status", f"answered {response.status_code}"
