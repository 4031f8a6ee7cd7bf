"""``/query_result`` entries as ACE-Step's clients read them, from our job and its view.

Per task: ``status`` a JSON number, 0 queued or running, 1 done, 2 failed or cancelled; a partly
failed job is 1 with its done takes (ACE-Step has no partial state). ``progress_text`` is the job's
own phase line (``Backbone generating · 42% · …``; ``take 1/2: …; take 2/2: …`` for several), where
ACE-Step sends the server's last log line. ``result`` is a JSON **string** of a list, as ACE-Step's:
while running one item with ``progress`` (0–1) and ``stage``; when done one item per finished take::

    {"file": "/v1/audio?path=<id>", "url": <the same>, "wave": "", "status": 1, "create_time": <s>,
     "env": "songserve", "prompt": <the style prompt as used>, "lyrics": <the cleaned lyrics>,
     "metas": {"duration": <seconds of this take>, "bpm": null, "genres": null, "keyscale": null,
               "timesignature": null, "prompt": <the caption as sent>, "lyrics": <the lyrics as sent>},
     "seed_value": "<seed of take 0>,<take 1>,…", "seed": <this take's>, "dit_model": <backbone>,
     "lm_model": <super-resolution model>, "generation_info": <one line>, "progress": 1.0, "stage": "succeeded"}

(``url`` is what ACE-Step's other server, the Gradio one, sends; harmless to the rest.) A failed
task's item and the entry carry ``error``. Unlike ACE-Step, which answers an unknown id as queued
forever, an unknown id is status 2 with ``result: "[]"`` and an ``error`` saying why.
"""

from __future__ import annotations

import json
from typing import Any

from songserve.api.acestep.files import AudioRef
from songserve.api.jobs.records import Job
from songserve.schemas import JobView, TrackView

DONE, FAILED = 1, 2
STATUS = {"completed": DONE, "partial": DONE, "failed": FAILED, "cancelled": FAILED}
ENV = "songserve"


def audio_format(job: Job) -> str:
    """The format the task asked for (a job made on our own port: MP3)."""
    extra = job.request.acestep
    return extra.audio_format if extra is not None else "mp3"


def caption_of(job: Job) -> str:
    """The caption as the task's client sent it (a job made on our own port: its style)."""
    extra = job.request.acestep
    return extra.caption if extra is not None else _style(job)


def _style(job: Job) -> str:
    r = job.request
    return r.tags if r.prompt_mode == "tags" else r.prompt


def _phase(t: TrackView) -> str:
    return f"{t.phase_display} ({t.error})" if t.status == "error" and t.error else t.phase_display


def progress_text(view: JobView) -> str:
    n = len(view.tracks)
    if n == 1:
        return _phase(view.tracks[0])
    return "; ".join(f"take {t.index + 1}/{n}: {_phase(t)}" for t in view.tracks)


def _models(job: Job, t: TrackView) -> tuple[str, str]:
    found = t.metadata.get("models")
    models: dict[str, Any] = found if isinstance(found, dict) else {}
    backbone = models.get("backbone") or job.request.backbone or ""
    return str(backbone), str(models.get("superres") or job.request.superres or "")


def take_item(job: Job, view: JobView, t: TrackView, seeds: str) -> dict[str, Any]:
    ref = AudioRef(job.job_id, t.index, audio_format(job))
    backbone, superres = _models(job, t)
    return {
        "file": ref.url,
        "url": ref.url,
        "wave": "",
        "status": DONE,
        "create_time": int(job.created_at),
        "env": ENV,
        "prompt": _style(job),
        "lyrics": view.cleaned_lyrics,
        "metas": {
            "duration": round(t.duration_sec, 2),
            "bpm": None,
            "genres": None,
            "keyscale": None,
            "timesignature": None,
            "prompt": caption_of(job),
            "lyrics": job.request.lyrics,
        },
        "seed_value": seeds,
        "seed": t.seed,
        "dit_model": backbone,
        "lm_model": superres,
        "generation_info": (
            f"songserve · backbone {backbone or '?'} · superres {superres or '?'} · take {t.index} · "
            f"seed {t.seed} · {t.duration_sec:.2f} s"
        ),
        "progress": 1.0,
        "stage": "succeeded",
    }


def _error(view: JobView) -> str:
    if view.status == "cancelled":
        return "The task was cancelled."
    reasons = [f"take {t.index}: {t.error}" for t in view.tracks if t.error]
    return "; ".join(reasons) or "The task failed."


def query_item(task_id: str, job: Job, view: JobView) -> dict[str, Any]:
    status = STATUS.get(view.status, 0)
    base = {"file": "", "wave": "", "create_time": int(job.created_at), "env": ENV}
    entry: dict[str, Any] = {"task_id": task_id, "status": status, "progress_text": progress_text(view)}
    if status == DONE:
        seeds = ",".join(str(t.seed) for t in view.tracks if t.seed is not None)
        items = [take_item(job, view, t, seeds) for t in view.tracks if t.status == "done"]
    elif status == FAILED:
        entry["error"] = _error(view)
        items = [{**base, "status": FAILED, "progress": 0.0, "stage": view.status, "error": entry["error"]}]
    else:
        progress = sum(t.progress for t in view.tracks) / max(1, len(view.tracks)) / 100
        items = [{**base, "status": 0, "progress": round(progress, 3), "stage": entry["progress_text"]}]
    entry["result"] = json.dumps(items, ensure_ascii=False)
    return entry


def unknown_item(task_id: str) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "status": FAILED,
        "progress_text": "",
        "result": "[]",
        "error": f"Task {task_id} is not known here (never made, or removed after its retention time).",
    }
