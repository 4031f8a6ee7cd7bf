"""``task_type: repaint`` as this model can serve it: continue a take from a point to its end.

ACE-Step's repaint regenerates ``repainting_start``–``repainting_end`` seconds of a source audio.
This model generates left to right, so what it can do is the open-ended case: keep the source up to
``repainting_start`` and generate on from there ("retake from a point"). ACE-Step writes "to the
end" as ``repainting_end`` -1, 0 or absent (``x if x else -1``), and any negative value reads the same.
The source is a file this server returned (``src_audio_path``: its ``file``, or the id in it) or an
upload (multipart ``src_audio``/``ctx_audio``).

Refused with a 400 naming the key: a finite end (the model cannot stop and rejoin the source), a
negative start, and no source at all. A reference audio or a foreign ``src_audio_path`` is refused
for every task type (``translate.py``). What a valid repaint becomes is one function,
``tasks.continue_from``: a retake (``continue_from``) of the source take from ``repainting_start``.
"""

from __future__ import annotations

from songserve.api.acestep.bodies import Upload
from songserve.api.acestep.failures import field_error
from songserve.api.acestep.files import AudioRef
from songserve.api.acestep.params import Params


def read(p: Params, source: AudioRef | None, upload: Upload | None) -> tuple[float, AudioRef | Upload]:
    """(start seconds, the source) of a repaint that continues to the end, or a 400."""
    end = p.number("repainting_end")
    if end is not None and end[1] > 0:
        raise field_error(
            end[0],
            f"a finite end ({end[1]:g} s) cannot be repainted: this model only continues a take to its end; "
            "send -1 (or leave it out)",
        )
    start = p.number("repainting_start")
    seconds = start[1] if start else 0.0
    if start and seconds < 0:
        raise field_error(start[0], "must be 0 or more seconds into the source")
    whence: AudioRef | Upload | None = source or upload
    if whence is None:
        raise field_error(
            "src_audio_path", "repaint needs a source: a file this server returned, or an uploaded src_audio"
        )
    return seconds, whence
