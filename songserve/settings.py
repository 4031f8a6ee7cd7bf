"""One settings object per process, fed by environment variables and command-line flags.

Every field can be set as an environment variable (upper case, e.g. ``RUNTIME_MODE``) or a flag
(``--runtime-mode``); flags win. Bad values refuse to start with a one-line reason, and the
non-default values are logged at start-up with secrets redacted.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from songserve.errors import ConfigError
from songserve.http_errors import clean_msg
from songserve.schemas import WorkerAnnouncement
from songserve.urls import default_public_url, dispatcher_urls

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger(__name__)
S = TypeVar("S", bound=BaseSettings)
SECRET_WORDS = ("token", "key", "secret")
LAUNCH_NONCE = "set by run_backend.sh, echoed by /health: how it tells its own child from another process on the port"
CALLER_DIR_ENV = "SONGSERVE_CALLER_DIR"  # the folder run_backend.sh was run in (it cds to the repository)


def caller_path(value: Any) -> Any:
    """A relative path setting is the caller's: taken from the folder the launcher was run in
    (``SONGSERVE_CALLER_DIR``), else this process's working folder, never the repository's; and made
    absolute here, so every message about it prints the whole path. Empty stays empty (unset)."""
    if isinstance(value, str | Path) and str(value).strip():
        path = Path(value).expanduser()
        return path if path.is_absolute() else Path(os.environ.get(CALLER_DIR_ENV) or os.getcwd()) / path
    return value


class WorkerSettings(BaseSettings):
    """``backend_worker.py``: one process per GPU."""

    model_config = SettingsConfigDict(extra="ignore", protected_namespaces=())

    worker_port: int = Field(8001, ge=1, le=65535, description="HTTP port")
    host: str = Field("127.0.0.1", description="bind address (loopback unless told otherwise)")
    runtime_mode: Literal["one_shot", "keep_loaded", "park"] = Field(
        "one_shot",
        description="one_shot: superres + decoder loaded per request; keep_loaded: resident; "
        "park: kept in (pinned) host memory, moved to the device for their stage",
    )
    seed: int = Field(1283, ge=0, description="base seed for requests without seed_override")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gpu_id: int = Field(0, ge=0, description="reported GPU id (the launcher sets CUDA_VISIBLE_DEVICES)")
    master_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Megatron's process group: 0 = an in-process store, no port; a port = a "
        "TCP store on MASTER_ADDR:port (the reference's launcher sets both)",
    )
    master_addr: str = Field("127.0.0.1", min_length=1, description="where that store listens (MASTER_PORT set)")
    launch_nonce: str = Field("", max_length=64, description=LAUNCH_NONCE)
    checkpoints_dir: Path | None = Field(None, description="folder of the checkpoint set; unset = tiny set")
    tokenizer_path: Path | None = None
    backbone_models: str = Field("", description="name=path,… or JSON; default default_backbone=<dir>/backbone")
    superres_models: str = Field("", description="name=path,… or JSON; default default_superres=<dir>/superres")
    decoder_config_path: Path | None = None
    decoder_checkpoint_path: Path | None = None
    megatron_args: str = Field("", description="Megatron-LM flags overriding the model configs")
    trust_checkpoint_pickle: bool = Field(
        False, description="unpickle decoder checkpoints fully (runs code from the file): only for trusted files"
    )
    output_dir: Path = Field(ROOT / "generated_audio", description="where WAV, MP3 and JSON are written")
    mp3_bitrate_mode: Literal["CONSTANT", "VARIABLE", "AVERAGE"] = "CONSTANT"
    mp3_compression_level: float = Field(0.0, ge=0.0, le=1.0, description="0 = highest quality")
    eoa_min_share: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="share of the requested length before end-of-audio is accepted; 1.0 = exactly the requested "
        "length; unset = 0 for a real set (the model ends the song), 1.0 for the tiny set (its end-of-audio is noise)",
    )
    max_new_tokens: int = Field(
        23552,
        ge=2,
        description="backbone token budget (the reference's --num-tokens-to-generate), capped by the context",
    )
    prefill_chunk: int = Field(512, ge=1, description="prompt tokens per prefill chunk (a cancel lands between chunks)")
    kv_snapshot_mb: float = Field(
        2048.0, ge=0, description="memory for the backbone's KV of recent retakes' prefixes (an LRU); 0 = none kept"
    )
    kv_snapshot_memory: Literal["device", "host"] = Field(
        "device", description="where KV snapshots live: on the device, or in host memory (pinned on CUDA)"
    )
    compile: Literal["auto", "0", "1"] = Field(
        "auto", description="torch.compile the decode step (CUDA graphs on CUDA); auto = on for CUDA only"
    )
    decode_mode: Literal["auto", "eager", "compiled", "graphs", "fused"] = Field(
        "auto",
        description="the backbone's decode step: eager, compiled (torch.compile), graphs (CUDA graphs), "
        "fused (Triton kernels, captured on CUDA); auto = what COMPILE says (CUDA graphs on CUDA)",
    )
    max_batch: int = Field(4, ge=1, le=64, description="most takes of one request run as one batch")
    park_backbone: Literal["auto", "0", "1"] = Field(
        "auto",
        description="park mode: the backbone also waits in host memory while superres and decoder run; "
        "auto = only when the device lacks the memory for them (never on the CPU)",
    )
    decode_chunk_frames: int = Field(256, ge=0, description="decoder chunk; 0 = one pass")
    decode_context_frames: int = Field(16, ge=12, description="decoder context on each side of a chunk")
    preview_chunk_sec: float = Field(
        3.0, ge=0, le=60, description="live audio: seconds of new frames per preview window; 0 = no live audio"
    )
    preview_context_frames: int = Field(
        16, ge=0, le=512, description="live audio: frames before a window's new ones that super-resolution sees"
    )
    preview_levels: int = Field(
        0,
        ge=0,
        le=64,
        description="live audio: code levels the preview fills and decodes (fewer: cheaper, coarser); "
        "0 = auto: all 64 on CUDA, 16 on the CPU",
    )
    encode_chunk_frames: int = Field(512, ge=0, description="encoder chunk (an upload's audio); 0 = one pass")
    encode_context_frames: int = Field(16, ge=8, description="encoder context on each side of a chunk")
    max_audio_mb: float = Field(
        128.0, gt=0, description="largest audio file POST /encode takes (an upload the dispatcher sends)"
    )
    torch_threads: int = Field(1, ge=1, description="CPU threads for torch (1 is fastest for small models)")
    worker_token: str = Field(
        "", description="shared secret: every route but /health needs Authorization: Bearer <token>"
    )
    announce: str = Field(
        "",
        description="comma-separated dispatcher URLs this worker registers with (POST /workers); needs WORKER_TOKEN",
    )
    public_url: str = Field(
        "",
        description="the URL dispatchers call this worker at; unset = http://<host>:<worker_port>, "
        "a wildcard host (0.0.0.0, ::) replaced by this machine's name",
    )
    announce_interval_sec: float = Field(
        5.0, gt=0, le=1200, description="seconds between registrations; each lasts 3 × this"
    )
    stall_timeout_sec: float = Field(
        300.0, gt=0, description="a task with no progress this long makes /health say stalled"
    )
    drain_timeout_sec: float = Field(
        30.0, ge=0, description="on SIGTERM, how long the running task may finish before it is cancelled"
    )
    max_body_bytes: int = Field(
        16_000_000,
        ge=1024,
        description="largest request body: a retake carries its kept codes (≤ 3.4 MB a take at 15 minutes)",
    )
    min_free_disk_mb: float = Field(
        500.0, ge=0, description="below this much free space on the output disk, /health says disk_low"
    )
    output_ttl_sec: float = Field(
        86400.0, ge=0, description="output files older than this are removed (a safety net); 0 = never"
    )
    header_timeout_sec: float = Field(
        10.0, gt=0, description="a connection that has not sent its request headers in this time is closed"
    )
    pipeline: Literal["model", "test"] = Field("model", description="test = a deterministic tone, for scheduling tests")
    test_delay_s: float = Field(0.0, ge=0.0, description="test pipeline: seconds per track")
    test_hang: bool = Field(False, description="test pipeline: the model thread hangs (fault-injection tests)")
    test_max_audio_sec: float = Field(
        0.0, ge=0.0, description="test pipeline: the longest tone written, in seconds; 0 = the requested length"
    )
    test_untrained: bool = Field(
        False, description="test pipeline: /config says it runs an untrained set, as a tiny-set worker does"
    )

    # TOKENIZER_PATH and DECODER_*_PATH are not here: a relative one is under CHECKPOINTS_DIR (layout.py).
    _caller_paths = field_validator("checkpoints_dir", "output_dir", mode="before")(caller_path)

    @field_validator("announce")
    @classmethod
    def _announce_targets(cls, value: str, info: ValidationInfo) -> str:
        """Each an http(s) URL, and a token: a dispatcher refuses an announcement without one (it guards lyrics)."""
        if not value.strip():
            return ""
        try:
            urls = dispatcher_urls(value)
        except ValueError as exc:
            raise PydanticCustomError("announce_url", str(exc)) from None
        if urls and not info.data.get("worker_token"):
            raise PydanticCustomError(
                "announce_token", "announcing needs WORKER_TOKEN (the dispatchers' worker token); none is set"
            )
        return ",".join(urls)

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str, info: ValidationInfo) -> str:
        """Checked against the announcement contract now, so a bad one refuses start-up instead of a 422 forever."""
        if not value.strip():
            if not info.data.get("announce") or "host" not in info.data or "worker_port" not in info.data:
                return ""
            value = default_public_url(info.data["host"], info.data["worker_port"])
        try:
            return WorkerAnnouncement(url=value.strip()).url
        except ValidationError as exc:
            raise PydanticCustomError("public_url", clean_msg(exc.errors()[0]["msg"])) from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def load_settings(cls: type[S], argv: Sequence[str] | None = None, **overrides: Any) -> S:
    """Environment, then flags (generated from the fields), then keyword overrides."""
    parser = argparse.ArgumentParser(description=(cls.__doc__ or "").strip())
    for name, field in cls.model_fields.items():
        parser.add_argument(_flag(name), dest=name, default=None, help=field.description)
    ns = parser.parse_args(list(argv) if argv is not None else [])
    values = {k: v for k, v in vars(ns).items() if v is not None}
    values.update(overrides)
    try:
        return cls(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else ""
        got = "***" if any(w in name for w in SECRET_WORDS) else repr(err.get("input"))  # a secret stays unsaid
        raise ConfigError(f"Setting {name}: {clean_msg(err['msg'])} (got {got}).") from None


def log_non_default(settings: BaseSettings) -> None:
    for name, field in type(settings).model_fields.items():
        value = getattr(settings, name)
        if value != field.default:
            shown = "***" if any(w in name for w in SECRET_WORDS) and value else value
            log.info("setting %s=%s", name, shown)


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

    @field_validator("webhook_secret")
    @classmethod
    def _webhook_secret(cls, value: str) -> str:
        from songserve.api.webhook_sign import signing_key

        signing_key(value)  # a whsec_ secret that is not base64 refuses start-up
        return value

    @field_validator("webhook_allow")
    @classmethod
    def _webhook_allow(cls, value: str) -> str:
        from songserve.api.webhook_targets import WebhookPolicy

        WebhookPolicy(value)  # an item that is no host, address or CIDR refuses start-up
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
