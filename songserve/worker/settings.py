"""The worker's settings (``backend_worker.py``, one process per GPU): one object, from the environment
and flags through ``songserve.process.settings.load_settings``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from songserve.http.errors import clean_msg
from songserve.process.settings import LAUNCH_NONCE, ROOT, caller_path
from songserve.schemas import WorkerAnnouncement
from songserve.worker.urls import default_public_url, dispatcher_urls


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
    mp3_quality: int = Field(3, ge=0, le=9, description="LAME's algorithm quality at CONSTANT: 0 = best, 9 = quickest")
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
    edit_audio_mb: float = Field(
        1024.0,
        ge=0,
        description="host memory for the decoded audio of the latest takes (an LRU), so that an edit of one "
        "(a repaint, a new opening) decodes only the chunks it changes; 0 = none kept",
    )
    adapters_dir: Path = Field(
        ROOT / "adapters", description="folder of LoRA adapters, one subfolder each (PEFT's layout, docs/model.md)"
    )
    max_adapters: int = Field(
        4, ge=1, le=64, description="adapters held at once (one slot each in every model); least recently used evicted"
    )
    adapter_uploads_dir: Path | None = Field(
        None,
        validate_default=True,
        description="where adapters uploaded through the dispatcher are kept (ADAPTERS_DIR may be read-only); "
        "unset = OUTPUT_DIR/.adapter_uploads",
    )
    adapter_max_mb: float = Field(
        256.0, gt=0, description="largest adapter upload (PUT /adapters/{name}, both files) in MB"
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
    repaint_context_frames: int = Field(
        0,
        ge=0,
        description="a repaint's super-resolution: frames of the original on each side of the new ones in its "
        "window (cost follows the edit); 0 = the model's whole window around them",
    )
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
    onednn_primitive_cache_capacity: int = Field(
        64,
        ge=0,
        le=4096,
        description="oneDNN's cache of CPU kernels, one per convolution and input length (its own default, 1024, "
        "held ~0.7 GB on the tiny set with live audio); the variable oneDNN itself reads",
    )
    malloc_trim: bool = Field(
        True, description="after each batch and encoding, give the heap's freed pages back to the system (glibc)"
    )
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
    test_hold_file: str = Field(
        "", description="test pipeline: while this file exists, a track waits where its decoding would begin"
    )

    # TOKENIZER_PATH and DECODER_*_PATH are not here: a relative one is under CHECKPOINTS_DIR (layout.py).
    _caller_paths = field_validator("checkpoints_dir", "output_dir", "adapters_dir", mode="before")(caller_path)

    @field_validator("adapter_uploads_dir", mode="before")
    @classmethod
    def _adapter_uploads_dir(cls, value: object, info: ValidationInfo) -> object:
        """Unset: a folder of the worker's own output root, which it can write."""
        if value is None or (isinstance(value, str) and not value.strip()):
            out = info.data.get("output_dir")
            return out / ".adapter_uploads" if isinstance(out, Path) else None
        return caller_path(value)

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
