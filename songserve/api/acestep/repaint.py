"""``task_type: repaint`` as this model serves it: a bounded repaint, or a retake from a point to the end.

ACE-Step's repaint regenerates ``repainting_start``–``repainting_end`` seconds of a source audio. A
finite end inside the source is our bounded repaint (``continue_from.end_sec``: the part is written
again and rejoins the source near the end, the rest kept exactly); an end past the source's end, a
retake from the start that runs on to that end (an extension at the end); "to the end", which
ACE-Step writes as ``repainting_end`` -1, 0 or absent (``x if x else -1``; any negative value reads the
same), a retake from ``repainting_start``; a negative ``repainting_start`` with no end, an extension at
the start: a new opening of that many seconds (``continue_from.before_sec``). The source is a file this server returned
(``src_audio_path``: its ``file``, or the id in it) or an upload (multipart ``src_audio``/``ctx_audio``).

Refused with a 400 naming the key: an end not after the start, a negative start with a finite end
(an opening joins the source near its start; what follows is kept), and no source at all. A reference audio or a foreign
``src_audio_path`` is refused for every task type (``translate.py``). What a valid repaint becomes is
one function, ``tasks.continue_from``.
"""

from __future__ import annotations

from songserve.api.acestep.bodies import Upload
from songserve.api.acestep.failures import field_error
from songserve.api.acestep.files import AudioRef
from songserve.api.acestep.params import Params


def read(p: Params, source: AudioRef | None, upload: Upload | None) -> tuple[float, float | None, AudioRef | Upload]:
    """(start seconds, end seconds or None for "to the end", the source) of a repaint, or a 400."""
    end = p.number("repainting_end")
    start = p.number("repainting_start")
    seconds = start[1] if start else 0.0
    until = end[1] if end is not None and end[1] > 0 else None
    if end is not None and until is not None and seconds < 0:
        raise field_error(
            end[0],
            "must be -1 with a negative repainting_start: an extension at the start keeps the source from its join on",
        )
    if end is not None and until is not None and until <= seconds:
        raise field_error(end[0], f"must come after repainting_start ({seconds:g} s), or be -1 for the end")
    whence: AudioRef | Upload | None = source or upload
    if whence is None:
        raise field_error(
            "src_audio_path", "repaint needs a source: a file this server returned, or an uploaded src_audio"
        )
    return seconds, until, whence
