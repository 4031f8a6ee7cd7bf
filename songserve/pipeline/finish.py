"""Decoder and files for one take of a batch: the last stage of ``ModelPipeline._run_batch``.

The decoder decodes the take's whole code grid in chunks (``stages/codec.py``), then the WAV, the
MP3, the code grid and the JSON with the take's metadata are written (``stages/export.py``). The
decoding phase's progress covers both, half each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from songserve.pipeline.config import PipelineConfig
from songserve.pipeline.context import TaskContext
from songserve.pipeline.continuation import codes_header, continued, repainted
from songserve.pipeline.residency import Residency
from songserve.pipeline.stages.codec import AudioDecoder, decode_chunks, samples_touched
from songserve.pipeline.stages.export import Mp3Options, write_track
from songserve.pipeline.stages.join import Join
from songserve.pipeline.stages.kept_audio import Decoded, KeptAudio, decode_edit, usable
from songserve.pipeline.types import BackboneResult, TrackRequest, TrackResult

log = logging.getLogger(__name__)
DECODE_STEPS = 1000  # the decoding phase's progress unit: the decoder's chunks, then the files


@dataclass(frozen=True)
class BatchFacts:
    """What the takes of one batch share, for each one's metadata."""

    batch_size: int
    bb_name: str
    sr_name: str
    sr_prompt_len: int
    timings: dict[str, float]  # the batch's stage timings so far
    t_all: float  # perf_counter at the batch's start
    parked: dict[str, list[str]] | None  # park mode: the stages parked during each stage


def decode_take(
    decoder: AudioDecoder,
    device: torch.device,
    codes: torch.Tensor,  # (levels the decoder reads, frames), on the CPU
    req: TrackRequest,
    joins: list[Join] | None,
    chunking: tuple[int, int],  # DECODE_CHUNK_FRAMES, DECODE_CONTEXT_FRAMES
    kept: KeptAudio | None,
    on_chunk: Callable[[int, int], None],
) -> tuple[np.ndarray, list[tuple[int, int]] | None, tuple[int, int]]:
    """A take's audio (samples, channels), the samples each part of an edit may change (None for a take that
    is no edit), and the decoder chunks decoded of the grid's: fewer for an edit whose original's audio is
    kept here (``stages/kept_audio.py``)."""
    hop = decoder.cfg.hop
    frames = int(codes.shape[1])
    touched = None
    if req.prefix is not None and req.prefix.repaint is not None and joins:
        parts = list(zip(req.prefix.repaints(), joins, strict=True))
        touched = [samples_touched(frames, *chunking, hop, part.start, join.frame) for part, join in parts]
        original = kept.find(req.prefix.origin) if kept is not None else None
        if kept is not None and original is not None:
            spans = [(part.start, join.frame) for part, join in parts]
            shift = req.prefix.repaint.opening
            if usable(original, codes.numpy(), spans, shift, chunking, hop):
                edit = decode_edit(decoder, codes.to(device), original, touched, shift, chunking, on_chunk)
                kept.counted(True)
                return edit.audio, touched, (edit.chunks, edit.of)
            kept.counted(False)
            log.warning(
                "task %s: the kept audio of %s is not this grid's: decoding all of it", req.task_id, original.origin
            )
    with torch.inference_mode():
        wave = decoder.decode(codes.unsqueeze(0).to(device), *chunking, on_chunk)[0]
    every = len(decode_chunks(frames, *chunking))
    return wave.float().t().cpu().numpy(), touched, (every, every)


def finish_take(
    s: PipelineConfig,
    tiny: bool,
    residency: Residency,
    device: torch.device,
    req: TrackRequest,
    ctx: TaskContext,
    codes: torch.Tensor,  # (64, frames)
    bb: BackboneResult,
    batch: BatchFacts,
    live: dict[str, object] | None = None,
    joins: list[Join] | None = None,  # a repaint's joins, one per part (``stages/join.py``)
    adapter: dict[str, object] | None = None,  # name, scale, rank of the take's adapter
    kept: KeptAudio | None = None,  # the decoded audio of this worker's latest takes
) -> TrackResult:
    """Decoder and files for one take of a batch."""
    t = time.perf_counter()
    decoder = residency.decoder
    assert decoder is not None
    timings, t_all = dict(batch.timings), batch.t_all
    cfg = decoder.cfg
    # The decoding phase's percent covers the decoder and then the files, half each: on the CPU the
    # MP3 encoder takes about as long as the decoder (export.py), and a phase stuck at 100 % while
    # the files are written read as 99 % overall for the whole export.
    ctx.report("decoding", 0, DECODE_STEPS)

    def on_chunk(done: int, total: int) -> None:
        ctx.check()
        ctx.report("decoding", DECODE_STEPS * done // (2 * total), DECODE_STEPS, f"chunk {done}/{total}")

    def on_export(share: float, what: str) -> None:
        ctx.report("decoding", int(DECODE_STEPS * (1 + share) / 2), DECODE_STEPS, what)

    chunking = (s.decode_chunk_frames, s.decode_context_frames)
    grid_codes = codes[: cfg.n_codebooks]
    audio, touched, decoded = decode_take(decoder, device, grid_codes, req, joins, chunking, kept, on_chunk)
    timings["decoder_sec"] = time.perf_counter() - t
    duration_sec = audio.shape[0] / cfg.sample_rate
    metadata = {
        "task_id": req.task_id,
        "job_id": req.job_id,
        "track_index": req.track_index,
        "request": {k: v for k, v in asdict(req).items() if k not in ("task_id", "job_id", "track_index", "prefix")},
        "seed": req.seed,
        "models": {"backbone": batch.bb_name, "superres": batch.sr_name, "tiny_checkpoints": tiny},
        "tokens": {
            "backbone_prompt": bb.prompt_tokens,
            "backbone_new": bb.new_tokens,
            "superres_prompt": batch.sr_prompt_len,
            "frames": int(codes.shape[1]),
            "stopped_by": bb.stopped_by,
        },
        "prefill": bb.prefill,
        "stopped_by": bb.stopped_by,
        "batch_size": batch.batch_size,
        "timings": timings,
        "duration_sec": duration_sec,
        "requested_sec": req.duration * 60,
        "sample_rate": cfg.sample_rate,
        "channels": int(audio.shape[1]),
        "device": str(device),
        "runtime_mode": s.runtime_mode,
        "load_sec": dict(residency.load_sec),
    }
    if batch.parked is not None:  # park mode: which stages waited in host memory while each stage ran
        metadata["parked"] = batch.parked
    if req.prefix is not None and (req.prefix.repaint is None or req.prefix.repaint.start > 0):
        metadata["continued"] = continued(req.prefix, cfg.frame_rate)  # an opening keeps nothing before it
    if req.prefix is not None and joins and touched is not None:
        metadata["repainted"] = repainted(req.prefix, joins, touched)
        metadata["repainted"]["decoded_chunks"] = list(decoded)
    if live is not None:  # someone listened while it was made (its audio is not in these files)
        metadata["live"] = live
    if adapter is not None:
        metadata["adapter"] = adapter
    mp3 = Mp3Options(s.mp3_bitrate_mode, s.mp3_compression_level, s.mp3_quality).tagged(
        req.tags or req.description, req.track_index, req.lyrics
    )
    timings["model_sec"] = time.perf_counter() - t_all
    grid = (grid_codes.numpy(), codes_header(metadata, cfg.frame_rate))
    wav, mp3_name, meta, metadata = write_track(
        s.output_dir, audio, cfg.sample_rate, metadata, mp3, on_export, codes=grid
    )
    log.info("task %s: wrote %s (%.2fs audio) in %.2fs", req.task_id, wav, duration_sec, time.perf_counter() - t_all)
    if kept is not None and req.job_id:  # what an edit of this take decodes against
        kept.keep(Decoded(f"{req.job_id}/{req.track_index}", grid_codes.numpy().astype(np.int16), audio, chunking))
    codes_name = metadata["files"]["codes"]
    return TrackResult(wav, mp3_name, meta, duration_sec, bb.new_tokens, req.seed, metadata, codes_name)
