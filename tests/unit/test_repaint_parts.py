"""A repaint of several parts, as pure logic: the dispatcher's check of ``continue_from.parts`` against a
song (``retakes.repaint_parts``), the wire's ``PrefixCodes.parts`` (sent only for several parts), and the
metadata a take reports of its parts (``continuation.repainted``). No server, no event loop, no model."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from songserve.api.dispatch.retakes import repaint_parts
from songserve.api.workers.to_worker import our_request
from songserve.errors import FieldError
from songserve.pipeline.continuation import repainted
from songserve.pipeline.stages.join import Join
from songserve.pipeline.types import Prefix, Repaint
from songserve.schemas import ContinueFrom, PrefixCodes, WorkerGenerateRequest
from songserve.schemas.continuation import RepaintPart, RepaintSpan

FPS = 10.0  # frames per second, for round numbers
WINDOW_SEC = 1.0  # a join window of 10 frames


def parts(*spans: tuple[float, float]) -> list[RepaintPart]:
    return [RepaintPart(at_sec=a, end_sec=b) for a, b in spans]


def refusal(spans: list[tuple[float, float]], frames: int = 100) -> tuple[str, str]:
    with pytest.raises(FieldError) as got:
        repaint_parts(parts(*spans), frames, FPS, WINDOW_SEC)
    (detail,) = got.value.detail
    assert isinstance(detail["loc"][3], int)  # the part, a number as in pydantic's own refusals
    return ".".join(str(x) for x in detail["loc"][1:]), detail["msg"]


def test_parts_become_spans_in_frames_each_with_the_join_window():
    got = repaint_parts(parts((1.0, 2.0), (3.5, 4.0), (8.0, 10.0)), 100, FPS, WINDOW_SEC)
    assert [(s.start, s.end, s.window) for s in got] == [(10, 20, 10), (35, 40, 10), (80, 100, 10)]


def test_a_part_that_starts_just_past_the_join_window_of_the_one_before_is_served():
    assert [s.start for s in repaint_parts(parts((1.0, 2.0), (3.1, 4.0)), 100, FPS, WINDOW_SEC)] == [10, 31]


@pytest.mark.parametrize(
    ("spans", "field", "says"),
    [
        ([(1.0, 2.0), (3.5, 10.5)], "continue_from.parts.1.end_sec", "past the end"),
        ([(1.0, 2.0), (10.0, 10.0 + 1e-9)], "continue_from.parts.1.at_sec", "inside the song"),
        ([(0.05, 2.0), (3.5, 4.0)], "continue_from.parts.0.at_sec", "inside the song"),  # keeps no frame before it
        ([(1.0, 2.0), (3.51, 3.52)], "continue_from.parts.1.end_sec", "shorter than a frame"),
        ([(1.0, 3.0), (2.5, 4.0)], "continue_from.parts.1", "overlaps part 0"),
        ([(1.0, 2.0), (3.0, 4.0)], "continue_from.parts.1", "may rejoin"),  # exactly a window after its end
        ([(3.5, 4.0), (1.0, 2.0)], "continue_from.parts.1", "in order"),
        ([(1.0, 2.0), (3.5, 4.0), (4.5, 6.0)], "continue_from.parts.2", "may rejoin"),
    ],
)
def test_a_part_that_is_no_part_of_the_song_or_too_close_to_the_one_before_is_refused_naming_it(spans, field, says):
    named, message = refusal(spans)
    assert named == field
    assert says in message


def test_continue_from_takes_parts_instead_of_at_sec_and_end_sec_and_never_with_an_opening():
    two = [{"at_sec": 1, "end_sec": 2}, {"at_sec": 4, "end_sec": 5}]
    cf = ContinueFrom.model_validate({"job_id": "0123456789abcdef", "parts": two})
    assert cf.parts is not None
    assert [(p.at_sec, p.end_sec) for p in cf.parts] == [(1, 2), (4, 5)]
    for extra in ({"at_sec": 1.0}, {"end_sec": 3.0}, {"before_sec": 1.0}):
        with pytest.raises(ValidationError):
            ContinueFrom.model_validate({"job_id": "0123456789abcdef", "parts": two, **extra})
    with pytest.raises(ValidationError) as bad:
        ContinueFrom.model_validate({"job_id": "0123456789abcdef", "parts": [two[0], {"at_sec": 4, "end_sec": 3}]})
    assert bad.value.errors()[0]["loc"] == ("parts", 1, "end_sec")


def test_the_wire_sends_one_part_as_repaint_alone_and_several_as_parts_beside_the_first():
    raw = bytes(2 * 64 * 100)
    one = PrefixCodes.of(raw, 64, 100, "o", [RepaintSpan(start=10, end=20, window=5)])
    assert one.parts is None
    assert "parts" not in one.model_dump(exclude_none=True)  # the body an older worker of ours reads
    assert one.spans() == [RepaintSpan(start=10, end=20, window=5)]
    spans = [RepaintSpan(start=10, end=20, window=5), RepaintSpan(start=26, end=40, window=5)]
    two = PrefixCodes.of(raw, 64, 100, "o", spans)
    assert two.repaint == spans[0]
    assert two.spans() == spans
    assert PrefixCodes.model_validate_json(two.model_dump_json()).spans() == spans
    for bad in ([spans[0], RepaintSpan(start=25, end=40, window=5)], [spans[0], RepaintSpan(start=30, end=101)]):
        with pytest.raises(ValidationError):
            PrefixCodes.of(raw, 64, 100, "o", bad)  # within the first's join window; past the grid


def test_repainted_names_every_part_and_the_whole_repaint_by_its_first_start_and_its_last_join():
    spans = (Repaint(10, 20, 5), Repaint(40, 50, 5))
    prefix = Prefix(b"", 64, 100, "job/0", spans[0], spans)
    joins = [Join(22, 0.5, 0.75), Join(47, 0.25, 1.0)]
    meta = repainted(prefix, joins, [(1000, 5000), (30000, 60000)])
    assert meta["parts"] == [
        {
            "start_frame": 10,
            "end_frame": 20,
            "join_frame": 22,
            "join_score": 0.5,
            "end_score": 0.75,
            "changed_samples": [1000, 5000],
        },
        {
            "start_frame": 40,
            "end_frame": 50,
            "join_frame": 47,
            "join_score": 0.25,
            "end_score": 1.0,
            "changed_samples": [30000, 60000],
        },
    ]
    assert {k: meta[k] for k in ("start_frame", "end_frame", "join_frame", "join_score", "end_score")} == {
        "start_frame": 10,
        "end_frame": 50,
        "join_frame": 47,
        "join_score": 0.25,
        "end_score": 1.0,
    }
    assert meta["changed_samples"] == [1000, 60000]
    single = repainted(Prefix(b"", 64, 100, "job/0", spans[0]), joins[:1], [(1000, 5000)])
    assert single["changed_samples"] == [1000, 5000]
    assert len(single["parts"]) == 1


def test_our_worker_gets_parts_only_for_a_repaint_of_several_and_the_body_it_always_had_otherwise():
    raw = bytes(2 * 64 * 100)
    one = [RepaintSpan(start=10, end=20)]
    two = [*one, RepaintSpan(start=40, end=50)]
    bodies = [our_request(WorkerGenerateRequest(prefix=PrefixCodes.of(raw, 64, 100, "o", p))) for p in (None, one, two)]
    assert [sorted(b["prefix"]) for b in bodies] == [
        ["codes", "frames", "levels", "origin", "repaint"],
        ["codes", "frames", "levels", "origin", "repaint"],
        ["codes", "frames", "levels", "origin", "parts", "repaint"],
    ]
    assert our_request(WorkerGenerateRequest())["prefix"] is None
