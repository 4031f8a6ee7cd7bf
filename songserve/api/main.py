"""``python backend_api.py``: validate settings, then serve the dispatcher."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from songserve.api.http import tags
from songserve.api.service.keys import ApiKeys
from songserve.api.settings import DispatcherSettings
from songserve.api.store.sqlite.check import prepare_store
from songserve.api.webhooks.sign import signing_key
from songserve.api.webhooks.targets import WebhookPolicy
from songserve.errors import ConfigError
from songserve.process.logs import setup_logging
from songserve.process.settings import load_settings, log_non_default

log = logging.getLogger("songserve.api")


async def _check_pg(s: DispatcherSettings) -> None:
    """Connect and migrate the PostgreSQL store once (under its lock), so a bad STORE_URL fails in one line."""
    from songserve.api.store.postgres.conn import StoreLimits
    from songserve.api.store.postgres.store import PgStore

    limits = StoreLimits(s.store_statement_timeout_sec, s.store_lock_timeout_sec)
    store = await PgStore.open(s.store_url, s.my_id(), pool_size=1, limits=limits)
    log.info("job store: %s (shared; this dispatcher is %s)", store.where, s.my_id())
    await store.close()


def check_webhooks(s: DispatcherSettings) -> None:
    """The webhook settings, read the way the webhooks room reads them: a bad one refuses start-up."""
    checks = (("webhook_secret", signing_key), ("webhook_allow", WebhookPolicy))
    for name, check in checks:  # a whsec_ secret that is not base64; an item that is no host, address or CIDR
        try:
            check(getattr(s, name))
        except ValueError as exc:
            raise ConfigError(f"Setting {name}: {exc}.") from None


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    try:
        s = load_settings(DispatcherSettings, sys.argv[1:] if argv is None else argv)
        s.worker_list()
        check_webhooks(s)
        tags.load_catalogue(s.tags_file or tags.BUILTIN)  # a bad file refuses start-up here
        keys = ApiKeys.load(s.api_key, s.api_keys_file)  # so does a bad keys file
    except ConfigError as exc:
        print(f"dispatcher: {exc}", file=sys.stderr)
        return 2
    setup_logging("api", s.log_level)
    log_non_default(s)
    try:  # a damaged or unreachable store refuses start-up here, in one line, before uvicorn starts
        if s.store_url:
            asyncio.run(_check_pg(s))
        else:
            prepare_store(s.state_dir / "jobs.sqlite3", s.store_damaged, s.results_path())
    except ConfigError as exc:
        print(f"dispatcher: {exc}", file=sys.stderr)
        return 2
    log.info("workers: %s", ", ".join(s.worker_list()) or "none")
    if keys.enabled:
        log.info("API keys: %d, named %s", len(keys.names), ", ".join(keys.names))

    from songserve.api.acestep.app import serving_plan
    from songserve.api.http.app import create_app
    from songserve.http.serving import GracefulServer, header_timeout_protocol

    app = create_app(s)
    try:  # ACESTEP_PORT: ACE-Step's dialect on a second port of this process (unset: our port alone)
        served, sockets = serving_plan(s, app)
    except ConfigError as exc:
        print(f"dispatcher: {exc}", file=sys.stderr)
        return 2
    if sockets:
        log.info("ACE-Step's API on port %d", s.acestep_port)
    config = uvicorn.Config(
        served,
        host=s.host,
        port=s.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        http=header_timeout_protocol(s.header_timeout_sec),
    )
    GracefulServer(config, drain=lambda: app.state.service.drain(s.drain_timeout_sec)).run(sockets=sockets)
    return 0
