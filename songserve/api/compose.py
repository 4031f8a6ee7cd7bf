"""The composition root: every part of a dispatcher made in one place, and what start-up checks first.

``check`` reads what a dispatcher refuses to start on, each in one line (``ConfigError``): the worker
list, the webhook settings, the tag catalogue, the API keys (``check_settings``), then the job store
(``check_store``: PostgreSQL connected and migrated once under its lock, or the SQLite file checked
for damage and migrated). ``build`` opens the workers' HTTP client and the store, makes the parts
(``assemble``), starts them, and at the end drains, stops and closes them; it is the lifespan of
``http/app.py``'s app. ``main.py`` and the tests' in-thread dispatchers (``tests/support/in_thread.py``) both
call ``check`` and serve that app, so the program and the tests start the same dispatcher. In-process
tests over a transport of their own (``tests/support/fake_fleet.py``) call ``assemble`` with it.

Each route depends on the one part it uses (``http/deps.py``); no part routes to another.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from songserve.api.dispatch.dispatcher import Dispatcher
from songserve.api.http import tags
from songserve.api.loop_lag import LoopLag
from songserve.api.results import render
from songserve.api.results.artifacts import ArtifactStore
from songserve.api.results.retention import Retention
from songserve.api.service.adapters import AdapterService
from songserve.api.service.announcements import Announcements
from songserve.api.service.job_service import JobService, load_job
from songserve.api.service.keys import ApiKeys
from songserve.api.service.live import LiveStreams
from songserve.api.service.readings import Readings
from songserve.api.service.uploads import UploadService
from songserve.api.service.usage import UsageService
from songserve.api.settings import DispatcherSettings
from songserve.api.store.protocol import JobStore
from songserve.api.store.sqlite.check import prepare_store
from songserve.api.store.sqlite.store import SqliteStore
from songserve.api.webhooks.events import JobEvents
from songserve.api.webhooks.sender import WebhookSender
from songserve.api.webhooks.sign import signing_key
from songserve.api.webhooks.targets import WebhookPolicy
from songserve.api.workers.client import WorkerHttp
from songserve.errors import ConfigError
from songserve.http.keepalive import CLIENT_KEEPALIVE_SEC

log = logging.getLogger("songserve.api")


# ---- the checks before serving ------------------------------------------------------------------
@dataclass(frozen=True)
class Checked:
    """What start-up read and found sound: the settings, the API keys, the tag catalogue."""

    s: DispatcherSettings
    keys: ApiKeys
    tags: dict[str, dict[str, Any]]


def check_webhooks(s: DispatcherSettings) -> None:
    """The webhook settings, read the way the webhooks room reads them: a bad one refuses start-up."""
    checks = (("webhook_secret", signing_key), ("webhook_allow", WebhookPolicy))
    for name, check_one in checks:  # a whsec_ secret that is not base64; an item that is no host, address or CIDR
        try:
            check_one(getattr(s, name))
        except ValueError as exc:
            raise ConfigError(f"Setting {name}: {exc}.") from None


def check_settings(s: DispatcherSettings) -> Checked:
    """The settings that need reading beyond their types; ``ConfigError`` names the first that is wrong."""
    s.worker_list()
    check_webhooks(s)
    catalogue = tags.load_catalogue(s.tags_file) if s.tags_file else tags.TAGS  # a bad file refuses here
    keys = ApiKeys.load(s.api_key, s.api_keys_file)  # so does a bad keys file
    return Checked(s, keys, catalogue)


async def _check_pg(s: DispatcherSettings) -> None:
    """Connect and migrate the PostgreSQL store once (under its lock), so a bad STORE_URL fails in one line."""
    from songserve.api.store.postgres.conn import StoreLimits
    from songserve.api.store.postgres.store import PgStore

    limits = StoreLimits(s.store_statement_timeout_sec, s.store_lock_timeout_sec)
    store = await PgStore.open(s.store_url, s.my_id(), pool_size=1, limits=limits)
    log.info("job store: %s (shared; this dispatcher is %s)", store.where, s.my_id())
    await store.close()


def check_store(s: DispatcherSettings) -> None:
    """A damaged or unreachable store refuses start-up here, in one line, before a socket is served.

    Runs its own event loop for PostgreSQL: call it where none runs (before uvicorn starts)."""
    if s.store_url:
        asyncio.run(_check_pg(s))
    else:
        prepare_store(s.state_dir / "jobs.sqlite3", s.store_damaged, s.results_path())


def check(s: DispatcherSettings) -> Checked:
    """Every start-up check, in the order ``main`` runs them."""
    checked = check_settings(s)
    check_store(s)
    return checked


# ---- the parts ----------------------------------------------------------------------------------
@dataclass
class Parts:
    """One dispatcher's parts, each made once; the routes take the one they use (``http/deps.py``)."""

    s: DispatcherSettings
    keys: ApiKeys
    tags: dict[str, dict[str, Any]]
    store: JobStore
    artifacts: ArtifactStore
    dispatcher: Dispatcher
    webhooks: WebhookSender
    retention: Retention
    renders: render.Renders
    announcements: Announcements
    live: LiveStreams
    uploads: UploadService
    adapters: AdapterService
    usage: UsageService
    jobs: JobService
    readings: Readings
    lag: LoopLag

    async def start(self) -> None:
        async def sweep() -> None:
            async with self.store.exclusive("retention") as mine:
                if mine:  # with several dispatchers on one store, one sweeps at a time
                    await self.retention.sweep()

        self.lag.start()
        await self.webhooks.start()
        await self.dispatcher.start(
            [
                ("retention", sweep, self.s.sweep_interval_sec),
                ("webhooks", self.webhooks.step, 0.0),
                ("adapters", self.adapters.sync, self.s.health_interval),
            ]
        )

    async def drain(self, timeout: float) -> None:
        """Stop accepting; let running tracks finish up to ``timeout``; the queue stays persisted."""
        await self.dispatcher.drain(timeout)

    async def stop(self) -> None:
        await self.live.close()
        await self.dispatcher.stop()
        await self.webhooks.stop()
        self.renders.close()
        self.uploads.gate.close()
        await self.lag.stop()


def assemble(checked: Checked, store: JobStore, artifacts: ArtifactStore, http: WorkerHttp) -> Parts:
    """The parts over an open store, a results folder and the workers' HTTP client, not started."""
    s = checked.s
    events = JobEvents()  # what the dispatcher's track book tells the webhook sender
    dispatcher = Dispatcher(s, store, artifacts, http, events)
    lag = LoopLag(dispatcher.metrics.loop_lag.observe)
    dispatcher.metrics.watch_loop_lag(lag.worst)
    uploads = UploadService(s, store, artifacts, dispatcher)  # a person's own audio
    adapters = AdapterService(s, store, artifacts, dispatcher, uploads.gate)  # a key's own LoRA adapters
    renders = render.Renders(artifacts, s.render_concurrency, s.render_queue)

    live = LiveStreams(
        functools.partial(load_job, dispatcher, store),
        dispatcher.live_client,
        lambda job_id, idx: artifacts.path(job_id, idx, "wav"),
        dispatcher.changes,
        s.state_dir / "live",
        s.live_listeners_per_track,
        s.live_listeners_max,
    )
    return Parts(
        s=s,
        keys=checked.keys,
        tags=checked.tags,
        store=store,
        artifacts=artifacts,
        dispatcher=dispatcher,
        webhooks=WebhookSender(s, store, dispatcher.me, dispatcher.metrics, events),
        retention=Retention(store, artifacts, s.result_ttl_sec, s.results_max_mb),
        renders=renders,
        announcements=Announcements(s, store, dispatcher),  # workers that join and leave
        live=live,
        uploads=uploads,
        adapters=adapters,
        usage=UsageService(store),
        jobs=JobService(s, store, artifacts, dispatcher, uploads, renders, live, adapters),
        readings=Readings(s, dispatcher, lag),
        lag=lag,
    )


async def open_store(s: DispatcherSettings) -> JobStore:
    """The store the settings name: PostgreSQL when ``STORE_URL`` is set, else SQLite in the state folder."""
    if s.store_url:
        from songserve.api.store.postgres.conn import StoreLimits
        from songserve.api.store.postgres.store import PgStore  # psycopg is needed only here

        limits = StoreLimits(s.store_statement_timeout_sec, s.store_lock_timeout_sec)
        return await PgStore.open(s.store_url, s.my_id(), s.store_pool_size, limits=limits)
    return SqliteStore(s.state_dir / "jobs.sqlite3")


@asynccontextmanager
async def build(checked: Checked) -> AsyncIterator[Parts]:
    """The running dispatcher: its parts made and started; drained, stopped and closed when the block ends."""
    s = checked.s
    headers = {"Authorization": f"Bearer {s.worker_token}"} if s.worker_token else {}
    async with WorkerHttp.open(headers, s.live_listeners_max, CLIENT_KEEPALIVE_SEC) as http:
        store = await open_store(s)
        parts = assemble(checked, store, ArtifactStore(s.results_path()), http)
        watch = asyncio.create_task(checked.keys.watch()) if s.api_keys_file else None  # keys change, no restart
        try:
            await parts.start()
            yield parts
        finally:
            if watch is not None:
                watch.cancel()
            await parts.drain(s.drain_timeout_sec)
            await parts.stop()
            await store.close()
