"""The dispatcher's settings (``backend_api.py``): one object, from the environment and flags through
``songserve.process.settings.load_settings``."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from songserve.errors import ConfigError
from songserve.process.settings import LAUNCH_NONCE, ROOT, caller_path


class DispatcherSettings(BaseSettings):
    """``backend_api.py``: the dispatcher."""

    model_config = SettingsConfigDict(extra="ignore", protected_namespaces=(), populate_by_name=True)

    port: int = Field(8889, ge=1, le=65535, validation_alias="API_PORT")
    host: str = Field(
        "127.0.0.1", validation_alias="API_HOST", description="bind address; 0.0.0.0 to serve other hosts"
    )
    acestep_port: int | None = Field(
        None, ge=1, le=65535, description="also serve ACE-Step 1.5's API (release_task, …) on this port; unset = not"
    )
    num_workers: int = Field(1, ge=0, description="workers at worker_host:worker_base_port+i")
    worker_host: str = "127.0.0.1"
    worker_base_port: int = Field(8001, ge=1, le=65535)
    worker_urls: str = Field("", description="comma-separated worker URLs (other hosts); replaces num_workers")
    launch_nonce: str = Field("", max_length=64, description=LAUNCH_NONCE)
    health_interval: float = Field(1.0, gt=0, description="seconds between worker health polls")
    state_dir: Path = Field(ROOT / "state", description="job database and results")
    max_queue: int = Field(200, ge=1, description="queued tracks before POST /generate answers 429")
    max_tracks: int = Field(4, ge=1, description="most tracks per job")
    min_duration: float = Field(0.05, gt=0, description="minutes")
    max_duration: float = Field(10.0, gt=0, description="minutes")
    max_lyrics_chars: int = Field(10_000, ge=1)
    max_attempts: int = Field(3, ge=1, description="tries per track on worker loss or stall")
    repaint_join_window_sec: float = Field(
        1.0,
        ge=0,
        le=30,
        description="a repaint rejoins the original within this many seconds of continue_from.end_sec, where they agree best",
    )
    deadline_base_sec: float = Field(120.0, gt=0, description="track deadline = base + factor × audio seconds")
    deadline_factor: float = Field(20.0, gt=0)
    stall_timeout_sec: float = Field(120.0, gt=0, description="no progress for this long = stalled worker")
    offline_after_failures: int = Field(2, ge=1, description="missed health polls before a worker is offline")
    result_ttl_sec: float = Field(24 * 3600.0, gt=0, description="finished jobs and files are removed after this")
    results_max_mb: float = Field(10_240.0, gt=0, description="results folder cap; oldest finished jobs go first")
    sweep_interval_sec: float = Field(60.0, gt=0, description="seconds between retention sweeps")
    store_url: str = Field(
        "",
        description="empty = SQLite in STATE_DIR (one dispatcher); postgresql://… = a store several dispatchers share",
    )
    store_pool_size: int = Field(
        10, ge=1, le=200, description="PostgreSQL: connections per pool (one for routes, one for the loops)"
    )
    store_statement_timeout_sec: float = Field(
        5.0, gt=0, le=3600, description="PostgreSQL: a statement running longer is cut short (503, nothing written)"
    )
    store_lock_timeout_sec: float = Field(
        2.0, gt=0, le=3600, description="PostgreSQL: a statement waiting longer for a table or row lock gives up"
    )
    results_dir: Path | None = Field(
        None, description="finished files; unset = STATE_DIR/results (may be shared storage)"
    )
    dispatcher_id: str = Field(
        "", max_length=200, description="this dispatcher's name in a shared store; unset = <hostname>:<port>"
    )
    lease_ttl_sec: float = Field(
        5.0, ge=0.5, le=300, description="a dead dispatcher's workers and tracks move to another after this"
    )
    store_damaged: Literal["refuse", "move-aside"] = Field(
        "refuse", description="a damaged jobs.sqlite3 at start-up: refuse to start, or move it aside and start fresh"
    )
    drain_timeout_sec: float = Field(30.0, ge=0, description="on SIGTERM, wait this long for running tracks")
    bench_after_failures: int = Field(
        3, ge=1, description="a worker whose tracks fail this many times in a row for environment reasons is benched"
    )
    bench_sec: float = Field(60.0, gt=0, description="how long a benched worker gets no new track")
    # The longest song the model makes fills its 25,600-position context: ~595 s, a 105 MB WAV
    # (44.1 kHz, 16-bit stereo) and a 24 MB MP3 at 320 kbit/s.
    download_timeout_sec: float = Field(
        45.0, gt=0, description="copying one track's files from its worker: the whole copy, not one read"
    )
    download_floor_kb_per_sec: float = Field(
        256.0,
        ge=0,
        description="a result copy that moves fewer KB (1000 bytes) a second than this over its last 5 s is cut and "
        "charged to the worker, before DOWNLOAD_TIMEOUT_SEC; 0 = no floor",
    )
    max_result_mb: float = Field(128.0, gt=0, description="largest result file copied from a worker")
    live_listeners_per_track: int = Field(
        256, ge=1, description="live listeners of one track on this dispatcher; more get 503 with Retry-After"
    )
    live_listeners_max: int = Field(
        1024, ge=1, description="live listeners of all tracks on this dispatcher; more get 503 with Retry-After"
    )
    pack_tracks: Literal["auto", "always", "never"] = Field(
        "auto",
        description="run a job's tracks as one batch on a worker: auto = when more are queued than workers are free",
    )
    api_key: str = Field("", description="when set, clients send Authorization: Bearer <key>")
    api_keys_file: Path | None = Field(
        None,
        description='JSON of API keys with names and limits: {"<key>": {"name", "tracks_per_hour", "concurrent_jobs", '
        '"max_duration", "max_priority"}}; beside or instead of API_KEY',
    )
    webhook_secret: str = Field(
        "", description="signs webhook events (Standard Webhooks: whsec_<base64 key>, or any text); unset = no webhooks"
    )
    webhook_allow: str = Field(
        "", description="hosts, addresses, CIDRs or 'public' webhooks may target; unset = public addresses only"
    )
    webhook_retry_base_sec: float = Field(
        4.0, gt=0, le=300, description="wait before a failed webhook event's first retry; it doubles up to 5 minutes"
    )
    webhook_max_age_sec: float = Field(
        86400.0, gt=0, description="a webhook event not delivered this long after it happened is given up"
    )
    webhook_timeout_sec: float = Field(
        10.0, gt=0, le=120, description="a webhook receiver's whole answer must come within this"
    )
    public_page: bool = Field(True, description="with an API key: the page and /tags stay public")
    worker_token: str = Field("", description="shared secret sent to the workers")
    cors_origins: str = Field(
        "", description="comma-separated extra origins allowed by CORS (localhost ports always are)"
    )
    max_body_bytes: int = Field(1_000_000, ge=1024, description="largest request body")
    upload_max_mb: float = Field(
        128.0, gt=0, description="largest audio file POST /uploads takes (and an ACE-Step multipart body)"
    )
    adapter_max_mb: float = Field(
        256.0, gt=0, description="largest LoRA adapter POST /adapters takes (its two files together)"
    )
    max_uploaded_adapters: int = Field(
        16, ge=0, le=10_000, description="LoRA adapters one API key may have uploaded at once (each is on every worker)"
    )
    mcp_max_mb: float = Field(
        16.0,
        gt=0,
        le=1024,
        description="largest audio one MCP message carries: an upload_audio file, a take read as a resource",
    )
    upload_concurrency: int = Field(
        2, ge=1, le=64, description="uploads decoded and stored at once, on their own threads (each costs a CPU core)"
    )
    upload_queue: int = Field(
        32, ge=0, le=10_000, description="uploads waiting beyond those (bodies on disk); past that 503 with Retry-After"
    )
    strict_requests: bool = Field(
        False, description="422 for out-of-range values instead of reading them as the reference backend does"
    )
    lyrics_cleaning: Literal["reference", "preserve-scripts"] = Field(
        "reference", description="reference = the reference backend's cleaning; preserve-scripts keeps non-Latin words"
    )
    tags_file: Path | None = Field(None, description="JSON tag catalogue served at /tags; unset = the built-in one")
    render_concurrency: int = Field(
        2, ge=1, le=64, description="renders (GET /job/{id}/track/{i}/render) made at once, on threads of their own"
    )
    render_queue: int = Field(
        16, ge=0, le=10_000, description="different renders that may wait for a thread; beyond, 429 with Retry-After"
    )
    header_timeout_sec: float = Field(
        10.0, gt=0, description="a connection that has not sent its request headers in this time is closed"
    )
    log_level: str = "INFO"

    @field_validator("tags_file", "results_dir", "acestep_port", "api_keys_file", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value

    _caller_paths = field_validator("state_dir", "results_dir", "api_keys_file", "tags_file")(caller_path)

    @field_validator("acestep_port")
    @classmethod
    def _own_port(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value == info.data.get("port"):
            raise ValueError("must differ from API_PORT (each dialect has its own port)")
        return value

    @field_validator("store_url")
    @classmethod
    def _store_url(cls, value: str) -> str:
        if value and not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be empty (SQLite in STATE_DIR) or a postgresql:// URL")
        return value

    def results_path(self) -> Path:
        return self.results_dir or self.state_dir / "results"

    def my_id(self) -> str:
        """The name this dispatcher writes on its tracks and leases: stable across its restarts."""
        return self.dispatcher_id or f"{socket.gethostname()}:{self.port}"

    def worker_list(self) -> list[str]:
        urls = [u.strip().rstrip("/") for u in self.worker_urls.split(",") if u.strip()]
        if urls:
            for u in urls:
                if not u.startswith(("http://", "https://")):
                    raise ConfigError(f"Setting worker_urls: {u!r} is not an http(s) URL.")
            return urls
        return [f"http://{self.worker_host}:{self.worker_base_port + i}" for i in range(self.num_workers)]
