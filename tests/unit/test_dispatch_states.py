"""The dispatcher's track state machine, in process: fake workers behind ``httpx.MockTransport``.

One behaviour per test; each waits on visible state (the job view, the fake worker's records).
The real-process tests in test_faults.py prove the same paths end to end with SIGKILL.
"""

from __future__ import annotations

import asyncio

import pytest

from songserve.api.jobs.states import TrackStatus
from songserve.api.service.job_service import GoneError, StoreUnavailable
from songserve.api.store.protocol import StoreError
from songserve.errors import FieldError, NotFoundError
from songserve.schemas import GenerateRequest, JobView
from tests.support.fake_fleet import FakeFleet, Plan, aio, body, finished, run_job, until


@aio
async def test_a_track_runs_on_an_idle_worker_and_its_files_are_copied(tmp_path):
    async with FakeFleet(tmp_path) as f:
        view = await run_job(f)
        assert view.status == "completed"
        assert view.tracks[0].attempts == 1
        assert f.svc.artifacts.has(view.job_id, 0, "mp3")
        assert f.svc.artifacts.has(view.job_id, 0, "json")
        assert view.tracks[0].metadata["worker_id"] == 0


@aio
async def test_a_busy_answer_requeues_the_track_without_counting_an_attempt(tmp_path):
    async with FakeFleet(tmp_path) as f:
        f.workers[0].plans.append(Plan("busy"))
        view = await run_job(f)
        assert view.status == "completed"
        assert view.tracks[0].attempts == 1
        assert len(f.workers[0].generated) == 1


@aio
async def test_a_model_error_ends_the_track_without_a_retry(tmp_path):
    async with FakeFleet(tmp_path) as f:
        f.workers[0].plans.append(Plan("error", error="The model ran out of tune."))
        view = await run_job(f)
        assert view.status == "failed"
        assert view.tracks[0].error == "The model ran out of tune."
        assert len(f.workers[0].generated) == 1


@aio
async def test_a_lost_connection_retries_the_track_on_another_worker(tmp_path):
    async with FakeFleet(tmp_path, n=2) as f:
        f.workers[0].plans.append(Plan("drop"))
        view = await run_job(f)
        assert view.status == "completed"
        assert view.tracks[0].attempts == 2
        assert len(f.workers[1].generated) == 1


@aio
async def test_a_track_fails_once_its_attempts_run_out(tmp_path):
    async with FakeFleet(tmp_path, max_attempts=2) as f:
        f.workers[0].plans.extend([Plan("drop"), Plan("drop")])
        view = await run_job(f)
        assert view.status == "failed"
        assert "after 2 attempts" in (view.tracks[0].error or "")


@aio
async def test_a_worker_that_stops_the_task_by_itself_gets_the_track_again(tmp_path):
    async with FakeFleet(tmp_path) as f:
        f.workers[0].plans.append(Plan("cancelled"))
        view = await run_job(f)
        assert view.status == "completed"
        assert view.tracks[0].attempts == 2


@aio
async def test_progress_from_the_workers_health_moves_the_track_through_its_phases(tmp_path):
    async with FakeFleet(tmp_path) as f:
        release = asyncio.Event()
        f.workers[0].plans.append(Plan(release=release))
        job_id = (await f.svc.submit(body())).job_id
        await until(lambda: f.workers[0].task_id is not None)
        f.workers[0].phase, f.workers[0].progress = "superres", 50
        await until(lambda: f.holds(job_id, lambda v: v.tracks[0].status == "superres"))
        t = (await f.svc.view(job_id)).tracks[0]
        assert t.progress == 80  # 70 + 20 × 50 %
        assert t.phase_display == "Super-Resolution Generating · 50%"
        release.set()
        await until(finished(f, job_id))
        assert (await f.svc.view(job_id)).tracks[0].progress == 100


@aio
async def test_a_worker_without_progress_loses_its_track_to_another(tmp_path):
    async with FakeFleet(tmp_path, n=2, stall_timeout_sec=0.2) as f:
        f.workers[0].plans.append(Plan(release=asyncio.Event()))  # never released, never progresses
        view = await run_job(f)
        assert view.status == "completed"
        assert view.tracks[0].attempts == 2
        assert f.workers[0].cancels == [f.workers[0].generated[0]]


@aio
async def test_a_track_past_its_deadline_is_stopped_and_run_again(tmp_path):
    async with FakeFleet(tmp_path, deadline_base_sec=0.2, deadline_factor=0.0001) as f:
        f.workers[0].plans.append(Plan(release=asyncio.Event()))
        view = await run_job(f)
        assert view.status == "completed"
        assert view.tracks[0].attempts == 2
        assert f.workers[0].cancels[:1] == [f.workers[0].generated[0]]


@aio
async def test_concurrent_stops_of_one_attempt_collapse_into_one_retry(tmp_path):
    async with FakeFleet(tmp_path, n=2) as f:
        f.workers[0].plans.append(Plan(release=asyncio.Event()))
        job_id = (await f.svc.submit(body())).job_id
        await until(lambda: f.workers[0].task_id is not None)
        for reason in ("worker 0 went offline", "worker 0 stalled", "past its deadline"):
            f.svc.dispatcher.attempts.stop((job_id, 0), reason)
        await until(finished(f, job_id))
        view = await f.svc.view(job_id)
        assert view.status == "completed"
        assert view.tracks[0].attempts == 2
        assert len(f.workers[0].cancels) == 1
        assert len(f.workers[1].generated) == 1


@aio
async def test_the_user_cancel_stops_the_running_track_and_frees_its_worker(tmp_path):
    async with FakeFleet(tmp_path) as f:
        f.workers[0].plans.append(Plan(release=asyncio.Event()))
        job_id = (await f.svc.submit(body(tracks=2))).job_id
        await until(lambda: f.workers[0].task_id is not None)
        await f.svc.cancel(job_id)
        await until(finished(f, job_id))
        view = await f.svc.view(job_id)
        assert view.status == "cancelled"
        assert [t.status for t in view.tracks] == ["cancelled", "cancelled"]
        assert f.workers[0].cancels == [f.workers[0].generated[0]]
        assert (await run_job(f)).status == "completed"  # the worker takes the next job


@aio
async def test_after_a_restart_a_task_that_finished_meanwhile_is_collected_not_rerun(tmp_path):
    f = FakeFleet(tmp_path)
    release = asyncio.Event()
    f.workers[0].plans.append(Plan(release=release))
    async with f:
        job_id = (await f.svc.submit(body())).job_id
        await until(lambda: f.workers[0].task_id is not None)
    release.set()  # the worker finishes while no dispatcher runs
    await until(lambda: bool(f.workers[0].finished))
    f.svc = f.new_service()
    async with f:
        await until(finished(f, job_id))
        view = await f.svc.view(job_id)
    assert view.status == "completed"
    assert view.tracks[0].attempts == 1
    assert len(f.workers[0].generated) == 1


@aio
async def test_after_a_restart_a_task_the_worker_forgot_runs_again(tmp_path):
    f = FakeFleet(tmp_path)
    f.workers[0].plans.append(Plan(release=asyncio.Event()))
    async with f:
        job_id = (await f.svc.submit(body())).job_id
        await until(lambda: f.workers[0].task_id is not None)
    f.workers[0].forget, f.workers[0].task_id = True, None  # it restarted
    f.svc = f.new_service()
    async with f:
        await until(finished(f, job_id))
        view = await f.svc.view(job_id)
    assert view.status == "completed"
    assert view.tracks[0].attempts == 2


@aio
async def test_a_store_write_failure_keeps_the_track_queued_until_the_store_recovers(tmp_path):
    async with FakeFleet(tmp_path) as f:
        store = f.svc.store
        real_claim, failures = store.claim, []

        async def failing_claim(tracks, fence):  # type: ignore[no-untyped-def]
            if len(failures) < 4:
                failures.append(tracks[0].status)
                raise StoreError("database or disk is full")
            return await real_claim(tracks, fence)

        store.claim = failing_claim  # type: ignore[method-assign]
        job_id = (await f.svc.submit(body())).job_id
        assert (await f.svc.view(job_id)).tracks[0].status == "queued"  # accepted; the write to start it failed
        await until(finished(f, job_id))
        assert (await f.svc.view(job_id)).status == "completed"
        assert len(failures) == 4


@aio
async def test_a_failed_write_at_submit_is_refused_and_leaves_no_job_behind(tmp_path):
    async with FakeFleet(tmp_path) as f:

        async def full(job, quota=None):  # type: ignore[no-untyped-def]
            raise StoreError("database or disk is full")

        f.svc.store.insert_job = full  # type: ignore[method-assign]
        with pytest.raises(StoreUnavailable) as err:
            await f.svc.submit(body())
        assert err.value.http_status == 507
        assert err.value.headers == {"Retry-After": "30"}
        assert await f.svc.store.counts() == {}
        assert not f.svc.dispatcher.book.queue


@aio
async def test_a_background_loop_survives_failing_iterations_and_reports_them(tmp_path):
    async with FakeFleet(tmp_path, sweep_interval_sec=0.01) as f:
        calls = []

        async def sweep(now=None):  # type: ignore[no-untyped-def]
            calls.append(now)
            if len(calls) <= 3:
                raise OSError("results disk unreadable")
            return 0

        f.parts.retention.sweep = sweep  # type: ignore[method-assign]
        await until(lambda: len(calls) >= 3)
        await until(lambda: "retention" in f.svc.dispatcher.loops.failing())
        ok, reason = f.parts.readings.ready()
        assert not ok
        assert "retention loop keeps failing" in reason
        await until(lambda: len(calls) >= 5, timeout=15)
        assert f.svc.dispatcher.loops.failing() == {}


@aio
async def test_metrics_record_queue_waits_stages_retries_and_finished_tracks(tmp_path):
    async with FakeFleet(tmp_path) as f:
        f.workers[0].plans.append(Plan("drop"))
        await run_job(f)
        metrics = f.svc.dispatcher.metrics
        await until(
            lambda: "songserve_tracks_finished_total{" in metrics.render().decode()
        )  # the job's finish is stored
        text = metrics.render().decode()
    assert "songserve_queue_wait_seconds_count 2.0" in text  # the first attempt and the retry
    assert 'songserve_stage_seconds_count{stage="backbone"} 1.0' in text
    assert "songserve_track_seconds_count 1.0" in text
    assert 'songserve_track_retries_total{worker="0"} 1.0' in text
    assert 'songserve_tracks_finished_total{status="done",worker="0"} 1.0' in text
    assert 'songserve_worker_state{state="idle",worker="0"} 1.0' in text
    assert "process_cpu_seconds_total" in text


@aio
async def test_collected_files_are_removed_on_the_worker(tmp_path):
    async with FakeFleet(tmp_path) as f:
        await run_job(f)
        assert f.workers[0].removed == f.workers[0].generated


@aio
async def test_an_environment_failure_moves_the_track_to_another_worker_without_counting_it(tmp_path):
    async with FakeFleet(tmp_path, n=2, max_attempts=1) as f:
        f.workers[0].plans.append(Plan("error", error="The worker's output disk is full (…/audio).", environment=True))
        view = await run_job(f)
        assert view.status == "completed"
        assert view.tracks[0].attempts == 1
        assert view.tracks[0].metadata["worker_id"] == 1


@aio
async def test_a_worker_failing_tracks_for_environment_reasons_is_benched_and_shown_degraded(tmp_path):
    async with FakeFleet(tmp_path, n=2, bench_after_failures=2) as f:
        disk_full = Plan("error", error="The worker's output disk is full (…/audio).", environment=True)
        f.workers[0].plans.extend([disk_full, disk_full])
        hold = asyncio.Event()
        f.workers[1].plans.append(Plan(release=hold))  # keep worker 1 busy: worker 0 gets both tracks
        first = (await f.svc.submit(body())).job_id
        await until(lambda: f.workers[1].task_id is not None)
        second = (await f.svc.submit(body())).job_id
        await until(lambda: f.svc.dispatcher.pool.workers[0].view.value == "degraded")
        assert len(f.workers[0].generated) == 2
        assert "failures of its own in a row" in (await f.parts.readings.status())["workers"][0]["degraded_reason"]
        hold.set()  # worker 1 frees up and takes both tracks; worker 0 stays benched
        for job_id in (first, second):
            assert (await until_done(f, job_id)).status == "completed"
        assert len(f.workers[0].generated) == 2


async def until_done(f: FakeFleet, job_id: str) -> JobView:
    await until(finished(f, job_id))
    return await f.svc.view(job_id)


@aio
async def test_a_worker_with_a_nearly_full_disk_gets_no_track(tmp_path):
    async with FakeFleet(tmp_path, n=2) as f:
        f.workers[0].disk_low = True
        await until(lambda: f.svc.dispatcher.pool.workers[0].view.value == "degraded")
        view = await run_job(f, tracks=2)
        assert view.status == "completed"
        assert f.workers[0].generated == []


@aio
async def test_an_idempotency_key_reused_with_another_body_is_refused(tmp_path):
    async with FakeFleet(tmp_path) as f:
        first = await f.svc.submit(body(), idempotency_key="k1")
        assert (await f.svc.submit(body(), idempotency_key="k1")).job_id == first.job_id
        with pytest.raises(FieldError) as err:
            await f.svc.submit(body(tracks=2), idempotency_key="k1")
        assert err.value.detail[0]["loc"] == ["body", "Idempotency-Key"]


@aio
async def test_a_done_tracks_missing_or_damaged_file_answers_gone(tmp_path):
    async with FakeFleet(tmp_path) as f:
        view = await run_job(f)
        f.svc.artifacts.path(view.job_id, 0, "mp3").unlink()
        f.svc.artifacts.path(view.job_id, 0, "wav").write_bytes(b"")
        for kind in ("mp3", "wav"):
            with pytest.raises(GoneError) as err:
                await f.svc.track_file(view.job_id, 0, kind)
            assert err.value.http_status == 410


@aio
async def test_a_file_finished_in_the_store_is_served_while_memory_is_behind(tmp_path):
    # With a shared store another dispatcher may finish a track a moment before this one's memory hears
    # of it (test_scaleout.py, real processes): the file is served from what the store holds, not 404.
    async with FakeFleet(tmp_path, n=2) as f:
        f.svc.store.shared = True  # as PostgreSQL's: only a shared store can be ahead of this dispatcher's memory
        hold = asyncio.Event()
        f.workers[1].plans.append(Plan(release=hold))  # one track waits, so the job stays in memory
        job_id = (await f.svc.submit(body(tracks=2))).job_id
        job = f.svc.dispatcher.active_job(job_id)
        assert job is not None
        await until(lambda: any(t.status is TrackStatus.done for t in job.tracks))
        done = next(t for t in job.tracks if t.status is TrackStatus.done)
        done.status = TrackStatus.decoding  # memory behind the store, as on a dispatcher that did not run it
        assert (await f.svc.track_file(job_id, done.index, "wav")).path.stat().st_size > 0
        with pytest.raises(NotFoundError):  # the held track is not done in the store either
            await f.svc.track_file(job_id, 1 - done.index, "wav")
        done.status = TrackStatus.done
        hold.set()
        assert (await until_done(f, job_id)).status == "completed"


@aio
async def test_retention_removes_results_folders_that_no_job_owns(tmp_path):
    import os
    import time

    async with FakeFleet(tmp_path) as f:
        kept = await run_job(f)
        orphan = f.svc.artifacts.root / "ab12cd34ef56ab78"
        orphan.mkdir()
        (orphan / "track_0.wav").write_bytes(b"x")
        old = time.time() - 3600
        os.utime(orphan, (old, old))
        await f.parts.retention.sweep()
        assert not orphan.exists()
        assert f.svc.artifacts.has(kept.job_id, 0, "wav")


@aio
async def test_a_track_whose_outcome_could_not_be_stored_is_collected_not_run_again(tmp_path):
    async with FakeFleet(tmp_path) as f:
        store = f.svc.store
        real_save, full = store.save_track, [True]

        async def save(t, seen, fence=None, events=()):  # type: ignore[no-untyped-def]
            if full[0] and t.status.value in ("done", "queued"):
                raise StoreError("database or disk is full")
            await real_save(t, seen, fence, events)

        store.save_track = save  # type: ignore[method-assign]
        job_id = (await f.svc.submit(body())).job_id
        await until(lambda: bool(f.workers[0].finished))  # it ran; "done" could not be written
        await until(lambda: not f.svc.dispatcher.attempts.running)
        assert (await f.svc.view(job_id)).tracks[0].status == "generating"
        full[0] = False  # space returns: the repair asks the worker (/tasks), which has the result
        await until(finished(f, job_id))
        assert (await f.svc.view(job_id)).status == "completed"
        assert len(f.workers[0].generated) == 1  # collected, not generated again
        assert (await f.svc.view(job_id)).tracks[0].attempts == 1


@aio
async def test_a_four_track_job_is_packed_onto_the_one_idle_worker(tmp_path):
    async with FakeFleet(tmp_path, max_batch=4) as f:
        view = await run_job(f, tracks=4)
        assert view.status == "completed"
        assert [len(b) for b in f.workers[0].batches] == [4]
        assert {t.metadata["worker_id"] for t in view.tracks} == {0}


@aio
async def test_four_idle_workers_each_get_one_track_of_a_four_track_job(tmp_path):
    async with FakeFleet(tmp_path, n=4, max_batch=4) as f:
        view = await run_job(f, tracks=4)
        assert view.status == "completed"
        assert [len(w.generated) for w in f.workers] == [1, 1, 1, 1]
        assert all(w.batches == [] for w in f.workers)


@aio
async def test_each_take_of_a_batch_moves_with_its_own_progress_and_finishes(tmp_path):
    async with FakeFleet(tmp_path, max_batch=2, pack_tracks="always") as f:
        hold = asyncio.Event()
        f.workers[0].plans.append(Plan(release=hold))
        job_id = (await f.svc.submit(body(tracks=2))).job_id
        await until(lambda: len(f.workers[0].running) == 2)
        f.workers[0].phase, f.workers[0].progress = "superres", 50
        await until(lambda: f.holds(job_id, lambda v: all(t.status == "superres" for t in v.tracks)))
        hold.set()
        view = await until_done(f, job_id)
        assert view.status == "completed"
        assert [len(b) for b in f.workers[0].batches] == [2]


@aio
async def test_the_phase_line_shows_the_token_rate_and_count_like_the_reference(tmp_path):
    async with FakeFleet(tmp_path) as f:
        hold = asyncio.Event()
        f.workers[0].plans.append(Plan(release=hold))
        job_id = (await f.svc.submit(body())).job_id
        await until(lambda: f.workers[0].task_id is not None)
        f.workers[0].progress, f.workers[0].detail, f.workers[0].rate = 42, "1100/3360 tokens", 180.4
        line = "Backbone generating · 42% · 180 tok/s · 1100 tokens"
        await until(lambda: f.holds(job_id, lambda v: v.tracks[0].phase_display == line))
        assert (await f.svc.view(job_id)).tracks[0].progress == 1 + 69 * 42 // 100
        hold.set()
        await until(finished(f, job_id))


@aio
async def test_a_song_longer_than_any_workers_context_is_refused_before_any_work(tmp_path):
    async with FakeFleet(tmp_path) as f:
        with pytest.raises(FieldError) as err:
            await f.svc.submit(GenerateRequest(lyrics="x", duration=10, num_tracks=1))
        assert err.value.detail[0]["loc"] == ["body", "duration"]
        assert "context of 25600 tokens" in str(err.value)
        assert f.workers[0].generated == []
        assert (await run_job(f)).status == "completed"  # 0.05 minutes fit


@aio
async def test_cancelling_a_queued_job_moves_the_jobs_behind_it_up_the_queue(tmp_path):
    async with FakeFleet(tmp_path) as f:
        hold = asyncio.Event()
        f.workers[0].plans.append(Plan(release=hold))
        running_job = (await f.svc.submit(body())).job_id
        await until(lambda: f.workers[0].task_id is not None)
        first, second = (await f.svc.submit(body())).job_id, (await f.svc.submit(body())).job_id
        assert (await f.svc.view(second)).queue_position == 2
        await f.svc.cancel(first)
        assert (await f.svc.view(second)).queue_position == 1
        hold.set()
        await until(finished(f, running_job))
        await until(finished(f, second))
        assert (await f.svc.view(second)).status == "completed"
