"""``python backend_api.py``: check the settings and the store (``compose.py``), then serve the dispatcher."""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Sequence

from songserve.api.compose import check_settings, check_store
from songserve.api.settings import DispatcherSettings
from songserve.errors import ConfigError
from songserve.process.logs import setup_logging
from songserve.process.settings import load_settings, log_non_default

log = logging.getLogger("songserve.api")


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    try:  # compose.check's two halves, with the log set up between them (the store's check logs)
        s = load_settings(DispatcherSettings, sys.argv[1:] if argv is None else argv)
        checked = check_settings(s)
    except ConfigError as exc:
        print(f"dispatcher: {exc}", file=sys.stderr)
        return 2
    setup_logging("api", s.log_level)
    log_non_default(s)
    try:
        check_store(s)
    except ConfigError as exc:
        print(f"dispatcher: {exc}", file=sys.stderr)
        return 2
    log.info("workers: %s", ", ".join(s.worker_list()) or "none")
    if checked.keys.enabled:
        log.info("API keys: %d, named %s", len(checked.keys.names), ", ".join(checked.keys.names))

    from songserve.api.acestep.app import serving_plan
    from songserve.api.http.app import create_app
    from songserve.http.serving import GracefulServer, header_timeout_protocol

    app = create_app(checked)
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
    # What start-up made (the imports, the app, its schemas: most of the heap) lives as long as the
    # process: frozen, it is left out of every later collection. Each full collection walked it again:
    # under a thousand waiting clients, 150-220 ms of held event loop each (70-115 ms frozen).
    # The collection thresholds stay Python's: a gen-2 threshold of 100 (not 10) made full collections
    # rarer but left the loop's mean and worst lag as they were (measured under 1,000 waiting clients),
    # while cyclic garbage would live ten times longer.
    gc.collect()
    gc.freeze()
    GracefulServer(config, drain=lambda: app.state.parts.drain(s.drain_timeout_sec)).run(sockets=sockets)
    return 0
