"""Dispatcher logic in isolation: lyrics cleaning, validation, status derivation, queue order, retention."""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import pytest

from songserve.api.dispatch import queue_order, retries
from songserve.api.dispatch.placement import NO_ADAPTER, NO_WORKER
from songserve.api.jobs.facts import Waiting
from songserve.api.jobs.records import Job, Track
from songserve.api.jobs.states import IllegalTransition, JobStatus, TrackStatus, check_transition, job_status
from songserve.api.jobs.views import job_view
from songserve.api.lyrics import clean_lyrics
from songserve.api.service.job_service import QueueFull, job_ended, view_ended
from songserve.api.settings import DispatcherSettings
from songserve.errors import FieldError
from songserve.schemas import GenerateRequest
from tests.support.fake_fleet import assemble_parts
from tests.support.http import TLS

pytestmark = pytest.mark.quick

# ---- lyrics cleaning: every rule of api.md ----------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("你好。世界，真的！吗？是：的；", "你好.世界,真的!吗?是:的;"),
        ("（a）【b】「c」『d』《e》、", "(a)[b]\"c\"'d'<e>,"),
        ("“f”‘g’", "\"f\"'g'"),
        ("a——b–c—d―e﹣f", "a-b-c-d-e-f"),
        ("wait…", "wait..."),
        ("la～", "la~"),
        ("a・b", "a b"),
        ("〖x〗〈y〉", "[x]<y>"),
        ("ＨＥＬＬＯ１２３！？", "HELLO123!?"),
        ("Неllo Κing οf", "Нello King οf"),  # the reference folds Cyrillic е and Greek Κ, not Н or ο
        ("zero\u200bwidth\ufeff", "zerowidth"),
        ("a\u00a0b\u3000c\u2028d\u2009e", "a b c d\u2009e"),
        ("don′t donʼt don´t", "don't don't don't"),
        ("¨q¨ a·b 2×3 6÷2 a|b", '"q" a.b 2x3 6/2 a-b'),
        ("star ★ here 🎵", "star  here 🎵"),
        ("bell\x07 esc\x1b tab\tkeep", "bell\x07 esc\x1b tab\tkeep"),
        ("one\n\n\n\ntwo\n \n\nthree", "one\n\n\n\ntwo\n \n\nthree"),
        ("  \n[verse]\nline\n  ", "[verse]\nline"),
        ("a\r\nb", "a\r\nb"),
    ],
)
def test_lyrics_cleaning(raw, clean):
    assert clean_lyrics(raw) == clean
    assert clean_lyrics(clean) == clean  # idempotent


# ---- states ---------------------------------------------------------------------------------------

Q, G, S, D, OK, E, C = (
    TrackStatus.queued,
    TrackStatus.generating,
    TrackStatus.superres,
    TrackStatus.decoding,
    TrackStatus.done,
    TrackStatus.error,
    TrackStatus.cancelled,
)


@pytest.mark.parametrize(
    ("tracks", "cancelled", "want"),
    [
        ([OK, OK], False, JobStatus.completed),
        ([OK, E], False, JobStatus.partial),
        ([E, E], False, JobStatus.failed),
        ([OK, C], True, JobStatus.cancelled),
        ([Q, Q], True, JobStatus.cancelled),
        ([G, Q], False, JobStatus.generating),
        ([OK, D], False, JobStatus.generating),
        ([S], False, JobStatus.generating),
        ([Q, Q], False, JobStatus.queued),
        ([OK, Q], False, JobStatus.pending),
        ([E, Q], False, JobStatus.pending),
    ],
)
def test_job_status_derivation(tracks, cancelled, want):
    assert job_status(tracks, cancelled) is want


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_waiter_reads_the_end_of_a_job_from_its_records_as_its_view_says_it(cancelled):
    """``Prefer: wait`` checks the records (``job_ended``) and makes the view only at the end: both say the
    same for every pair of track states, a cancelled job's running tracks included."""
    req = GenerateRequest(lyrics="x", num_tracks=2)
    for first, second in itertools.product(TrackStatus, repeat=2):
        tracks = [Track("j", 0, seed=0, status=first), Track("j", 1, seed=1, status=second)]
        job = Job("j", 1, created_at=100.0, request=req, cleaned_lyrics="x", tracks=tracks, cancelled=cancelled)
        assert job_ended(job) == view_ended(job_view(job, {}, None)), (first, second)


def test_a_job_reads_started_and_finished_from_its_tracks_before_its_own_marks_land():
    """A job reads terminal the moment its last track does; its own times are separate, later writes."""
    req = GenerateRequest(lyrics="x", num_tracks=2)
    tracks = [Track("j", i, seed=i) for i in range(2)]
    job = Job("j", 1, created_at=100.0, request=req, cleaned_lyrics="x", tracks=tracks)
    view = job_view(job, {}, None)
    assert (view.status, view.started_at, view.finished_at) == ("queued", None, None)
    tracks[0].status, tracks[0].started_at = G, 101.0
    view = job_view(job, {}, None)
    assert (view.status, view.started_at, view.finished_at) == ("generating", 101.0, None)
    tracks[0].status, tracks[0].finished_at = OK, 103.0
    tracks[1].status, tracks[1].finished_at = C, 102.0  # cancelled while queued: never started
    view = job_view(job, {}, None)
    assert (view.status, view.started_at, view.finished_at) == ("partial", 101.0, 103.0)
    job.started_at, job.finished_at = 101.5, 104.0  # the job's own marks win once written
    view = job_view(job, {}, None)
    assert (view.started_at, view.finished_at) == (101.5, 104.0)


def test_a_queued_track_says_the_plans_reason_or_the_passs_and_no_other_track_says_one():
    req = GenerateRequest(lyrics="x", num_tracks=3)
    tracks = [Track("j", i, seed=i) for i in range(3)]
    job = Job("j", 1, created_at=100.0, request=req, cleaned_lyrics="x", tracks=tracks)
    tracks[2].status = G
    planned = Waiting({("j", 0): NO_ADAPTER}, otherwise=None)
    assert [t.waiting for t in job_view(job, {}, None, planned).tracks] == [NO_ADAPTER, None, None]
    busy = Waiting(otherwise=NO_WORKER)  # no plan made: every worker busy
    assert [t.waiting for t in job_view(job, {}, None, busy).tracks] == [NO_WORKER, NO_WORKER, None]
    assert [t.waiting for t in job_view(job, {}, None).tracks] == [None, None, None]
    job.cancelled = True
    assert [t.waiting for t in job_view(job, {}, None, busy).tracks] == [None, None, None]


def test_track_transitions():
    check_transition(Q, G)
    check_transition(G, S)
    check_transition(S, Q)  # retry
    check_transition(D, OK)
    for bad in ((Q, OK), (OK, Q), (E, G), (C, Q)):
        with pytest.raises(IllegalTransition):
            check_transition(*bad)


def test_retry_rules_spare_environment_failures_each_workers_share_and_give_up_when_tries_run_out():
    assert retries.RetryTrack("disk full", environment=True).count is False  # never counted on its own
    assert retries.RetryTrack("busy", count=False).count is False
    assert retries.RetryTrack("lost").count is True
    assert retries.environment_share(3, 4) == 12  # past 12 environment failures they count again
    assert retries.environment_share(3, 0) == 3  # an empty pool still gives the track its own tries
    assert retries.tries_used(2, count=True) == 2
    assert retries.tries_used(2, count=False) == 1  # the try it began is given back
    assert retries.tries_used(0, count=False) == 0
    assert retries.given_up(2, 3, "worker 0 connection lost") is None
    assert (
        retries.given_up(3, 3, "worker 0 connection lost") == "Track failed after 3 attempts: worker 0 connection lost."
    )


# ---- scheduler order ------------------------------------------------------------------------------


def E_(job, idx, prio=0, seq=None):
    return queue_order.QueueEntry(job, idx, prio, seq if seq is not None else ord(job[0]))


def keys(entries):
    return [f"{e.job_id}{e.index}" for e in entries]


def test_priority_first_then_fifo():
    q = [E_("a", 0), E_("b", 0), E_("c", 0, prio=5)]
    assert keys(queue_order.order(q, {})) == ["c0", "a0", "b0"]


def test_fair_across_jobs():
    # Job a (4 tracks) came first and two of its tracks already run; b (1 track) came later.
    q = [E_("a", 2), E_("a", 3), E_("b", 0)]
    assert keys(queue_order.order(q, {"a": 2})) == ["b0", "a2", "a3"]
    # Nothing started yet: round robin between a and b, older job first at each level.
    q = [E_("a", i) for i in range(4)] + [E_("b", 0), E_("b", 1)]
    assert keys(queue_order.order(q, {})) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_fifo_within_a_job_and_priority_beats_fairness():
    q = [E_("a", 1), E_("a", 0), E_("b", 0, prio=1)]
    assert keys(queue_order.order(q, {"b": 9})) == ["b0", "a0", "a1"]


# ---- validation and retention through the service (no workers) ------------------------------------


@pytest.fixture
def service(tmp_path):
    async def make(**settings):
        s = DispatcherSettings(state_dir=tmp_path, num_workers=0, **settings)
        return assemble_parts(s, tmp_path, httpx.AsyncClient(verify=TLS))  # compose.assemble, not started

    return make


def test_validation_names_the_field(service):
    async def go():
        svc = (await service(max_duration=5.0, max_tracks=3, strict_requests=True)).jobs
        for body, field in [
            ({"duration": 6.0, "lyrics": "x"}, "duration"),
            ({"num_tracks": 4, "lyrics": "x"}, "num_tracks"),
            ({"lyrics": " ★ \u200b "}, "lyrics"),
        ]:
            with pytest.raises(FieldError) as err:
                await svc.submit(GenerateRequest(**body))
            assert err.value.detail[0]["loc"] == ["body", field]
            assert field in str(err.value)
        # instrumental needs no lyrics
        assert (await svc.submit(GenerateRequest(mode="instrumental", duration=1.0))).num_tracks == 2

    asyncio.run(go())


def test_queue_bound_answers_queue_full_with_retry_after(service):
    async def go():
        svc = (await service(max_queue=5)).jobs
        await svc.submit(GenerateRequest(lyrics="x", num_tracks=4))
        with pytest.raises(QueueFull) as err:
            await svc.submit(GenerateRequest(lyrics="x", num_tracks=2))
        assert int(err.value.headers["Retry-After"]) >= 1
        await svc.submit(GenerateRequest(lyrics="x", num_tracks=1))

    asyncio.run(go())


def test_retention_removes_old_and_oversized_finished_jobs_never_active_ones(service, tmp_path):
    async def go():
        parts = await service(result_ttl_sec=3600, results_max_mb=1.0)
        svc = parts.jobs
        ids = [(await svc.submit(GenerateRequest(lyrics="x", num_tracks=1))).job_id for _ in range(4)]
        # Finish three of them by hand: a day old, fresh with a big file, fresh with a small file.
        for n, (job_id, age, size) in enumerate(zip(ids[:3], (86400, 10, 5), (10, 900_000, 600_000), strict=True)):
            job = svc.dispatcher.book.jobs[job_id]
            job.finished_at = time.time() - age + n
            await svc.dispatcher.book.cancel_queued(job)
            await svc.dispatcher.book.finish_if_done(job)
            p = svc.artifacts.path(job_id, 0, "wav")
            p.parent.mkdir(parents=True)
            p.write_bytes(b"\0" * size)
        removed = await parts.retention.sweep()
        assert removed == 2  # the expired one, then the oldest fresh one until under 1 MB
        assert await svc.store.load_job(ids[0]) is None
        assert await svc.store.load_job(ids[1]) is None
        assert await svc.store.load_job(ids[2]) is not None
        assert await svc.store.load_job(ids[3]) is not None
        assert not (tmp_path / "results" / ids[0]).exists()

    asyncio.run(go())


def test_config_says_when_the_workers_run_an_untrained_set():
    from songserve.api.dispatch.readiness import config
    from songserve.api.jobs.facts import Fleet

    s = DispatcherSettings()
    trained = config(s, Fleet(["b"], ["s"], None, 2, untrained=0))
    assert (trained["untrained_workers"], trained["notice"]) == (0, None)
    tiny = config(s, Fleet(["b"], ["s"], None, 1, untrained=1))
    assert tiny["notice"] == (
        "Tiny test model: the audio is noise of the right length. Set CHECKPOINTS_DIR to a trained set to hear music."
    )
    mixed = config(s, Fleet(["b"], ["s"], None, 3, untrained=1))
    assert mixed["notice"] == (
        "1 of 3 workers run the tiny test model: the audio is noise of the right length; a take they make is not music."
    )
