"""Webhooks, the wait mode and keys with limits, in process: signing, backoff, the target rule, the
outbox's state machine on both store engines, and the job service with fake workers sending to a real
receiver on the loopback (``tests/support/receiver.py``). The real-process proofs: ``test_webhooks_process.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import re
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from songserve.api.http.routes import prefer_wait
from songserve.api.jobs.states import TrackStatus
from songserve.api.service.keys import ApiKeys, Caller
from songserve.api.service.usage import OverLimit
from songserve.api.store.outbox import WebhookEvent, retry_delay
from songserve.api.store.protocol import JobStore, StaleTrack
from songserve.api.store.quota import WINDOW_SEC, OverQuota, Quota, free_in
from songserve.api.webhooks.sign import headers, signature, signing_key, verify
from songserve.api.webhooks.targets import Refused, WebhookPolicy
from songserve.errors import ConfigError, FieldError
from songserve.schemas import GenerateRequest, KeyLimits
from tests.support.fake_fleet import FakeFleet, Plan, until
from tests.support.receiver import Receiver
from tests.support.stores import lease, new_job, running, two_stores

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # the Standard Webhooks specification's test secret
HOOKS = {"webhook_secret": SECRET, "webhook_allow": "127.0.0.1/32", "webhook_retry_base_sec": 0.05}


def aio(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 60))

    return run


# ---- signing, backoff, targets, the Prefer header, the hourly window ---------------------------------


def test_a_signature_matches_the_standard_webhooks_test_vector():
    body = b'{"test": 2432232314}'
    sig = signature(signing_key(SECRET), "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body)
    assert sig == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_a_signature_verifies_with_the_secret_and_fails_with_another():
    for secret in (SECRET, "a plain secret"):
        body = b'{"type": "completed"}'
        got = headers(signing_key(secret), "evt_1", body)
        assert verify(secret, got, body)
        assert not verify("whsec_" + "QUJD" * 8, got, body)
        assert not verify(secret, got, body + b" ")  # another body
        assert not verify(secret, {**got, "webhook-id": "evt_2"}, body)
        assert not verify(secret, got, body, now=time.time() + 600)  # a replay ten minutes later
    with pytest.raises(ValueError, match="base64"):
        signing_key("whsec_not base64!")


def test_retries_wait_from_the_base_doubling_up_to_five_minutes_less_a_jitter():
    assert [retry_delay(n, 4.0, lambda: 0.0) for n in range(1, 10)] == [4, 8, 16, 32, 64, 128, 256, 300, 300]
    assert retry_delay(9, 4.0, lambda: 0.999) == pytest.approx(240, abs=0.1)  # at most a fifth less
    waits = [retry_delay(1, 4.0) for _ in range(200)]
    assert all(3.2 <= w <= 4 for w in waits)  # the first retry comes within 5 s by default
    assert len(set(waits)) > 100  # spread: events that failed together retry apart


def test_unset_webhook_allow_refuses_loopback_private_and_link_local_addresses():
    policy = WebhookPolicy("")
    for addr, kind in [
        ("127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("192.168.0.9", "private"),
        ("169.254.169.254", "link-local"),
        ("::1", "loopback"),
        ("fd00::1", "private"),
        ("::ffff:127.0.0.1", "loopback"),
        ("100.64.0.1", "non-public"),
    ]:
        why = policy.why_not("h.example", ipaddress.ip_address(addr))
        assert why is not None, addr
        assert kind in why, why
        assert "WEBHOOK_ALLOW" in why
    assert policy.why_not("h.example", ipaddress.ip_address("93.184.216.34")) is None


def test_webhook_allow_lists_exactly_what_may_be_targeted():
    loop = WebhookPolicy("127.0.0.1/32")
    assert loop.why_not("x", ipaddress.ip_address("127.0.0.1")) is None
    assert loop.why_not("x", ipaddress.ip_address("93.184.216.34")) is not None  # not listed: not public either
    both = WebhookPolicy("public, 10.0.0.0/8, hooks.internal")
    assert both.why_not("x", ipaddress.ip_address("93.184.216.34")) is None
    assert both.why_not("x", ipaddress.ip_address("10.9.9.9")) is None
    assert both.why_not("hooks.internal", ipaddress.ip_address("192.168.1.1")) is None
    assert both.why_not("other.internal", ipaddress.ip_address("192.168.1.1")) is not None
    with pytest.raises(ValueError, match="neither"):
        WebhookPolicy("10.0.0.0/33")


@aio
async def test_a_target_is_the_checked_address_with_the_name_kept_for_host_and_tls():
    target = await WebhookPolicy("localhost").check("https://localhost:8443/hook?x=1")
    assert re.fullmatch(r"https://(127\.0\.0\.1|\[::1\]):8443/hook\?x=1", target.url)
    assert (target.host, target.sni) == ("localhost:8443", "localhost")
    with pytest.raises(Refused, match="loopback"):
        await WebhookPolicy("").check("http://127.0.0.1:9/hook")
    with pytest.raises(Refused, match="cannot be resolved"):
        await WebhookPolicy("public").check("http://no-such-host.invalid/hook")


def test_prefer_wait_is_read_as_rfc_7240_has_it_and_capped_at_60():
    assert prefer_wait("wait=10") == 10
    assert prefer_wait("respond-async, wait=5") == 5
    assert prefer_wait('wait="7"; foo') == 7
    assert prefer_wait("wait=600") == 60
    assert prefer_wait(None) is None
    assert prefer_wait("wait=soon") is None
    assert prefer_wait("waits=3") is None


def test_the_hourly_window_frees_tracks_as_their_hour_ends():
    now = 10_000.0
    recent = [(now - 3000, 1), (now - 1000, 1)]
    assert free_in(recent, 3, 1, now) == 0
    assert free_in(recent, 2, 1, now) == pytest.approx(600)  # the older one leaves the hour in 600 s
    assert free_in(recent, 2, 2, now) == pytest.approx(WINDOW_SEC - 1000)


def test_a_keys_file_names_keys_and_never_says_a_key(tmp_path: Path):
    f = tmp_path / "keys.json"
    f.write_text('{"k-studio": {"name": "studio", "tracks_per_hour": 2}, "k-anon": {}}')
    keys = ApiKeys.load("k-main", f)
    assert keys.identify(b"k-studio") == Caller("studio", KeyLimits(tracks_per_hour=2))
    assert keys.identify(b"k-main").name == "default"
    assert keys.identify(b"k-anon").name.startswith("key-")
    assert keys.identify(b"k-nope") is None
    assert keys.from_bearer(b"Bearer k-studio").name == "studio"
    f.write_text('{"k-secret-value": {"name": "x", "tracks_per_hour": -1}}')
    with pytest.raises(ConfigError) as err:
        ApiKeys.load("", f)
    assert "tracks_per_hour" in str(err.value)
    assert "k-secret-value" not in str(err.value)


# ---- the outbox and the quota in the store, on both engines ----------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "jobs.sqlite3")
    return str(request.getfixturevalue("pg_url"))


def event(job_id: str, kind: str = "completed", n: int = 0) -> WebhookEvent:
    return WebhookEvent(f"evt_{job_id}_{kind}_{n}", job_id, kind, "http://127.0.0.1:9/", "{}", time.time())


async def ids_claimed(store: JobStore, owner: str, lease_sec: float = 60) -> list[str]:
    return [d.event.event_id for d in await store.outbox.claim(owner, 10, lease_sec)]


def store_test(fn: Callable[[JobStore, JobStore], Coroutine[Any, Any, None]]) -> Callable[[str], None]:
    """A test of two dispatchers' stores (A and B) on one engine's store."""

    def run(engine: str) -> None:
        async def go() -> None:
            async with two_stores(engine) as s:
                await fn(s.a, s.b)

        asyncio.run(asyncio.wait_for(go(), 30))

    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


@store_test
async def test_an_event_is_written_only_with_the_change_it_reports(a: JobStore, b: JobStore):
    job = new_job("eeee000000000001", tracks=1)
    await a.insert_job(job)
    await a.mark_started(job.job_id, time.time(), [event(job.job_id, "start")])
    await b.mark_started(job.job_id, time.time(), [event(job.job_id, "start", 1)])  # started already: none
    t = job.tracks[0]
    won = running(t, "A")
    assert await a.claim([won], await lease(a, "A")) == {0}
    done = dataclasses.replace(won, status=TrackStatus.done, owner=None)
    with pytest.raises(StaleTrack):  # a stale write: neither the track nor its event
        await b.save_track(done, (TrackStatus.queued, None), None, [event(job.job_id, "track", 9)])
    await a.save_track(done, (TrackStatus.generating, "A"), None, [event(job.job_id, "track")])
    assert await a.finish_job(job.job_id, time.time(), [event(job.job_id)])
    assert await b.finish_job(job.job_id, time.time(), [event(job.job_id, n=1)])  # terminal already: none
    assert (await a.outbox.stats()).depth == 3
    got = []
    while batch := await a.outbox.claim("A", 10, 60):
        for d in batch:
            got.append(d.event.event_id)
            await a.outbox.delivered(d.row)
    assert got == [f"evt_{job.job_id}_start_0", f"evt_{job.job_id}_track_0", f"evt_{job.job_id}_completed_0"]


@store_test
async def test_a_jobs_events_are_claimed_in_order_one_at_a_time_by_one_dispatcher(a: JobStore, b: JobStore):
    for job_id in ("eeee000000000002", "eeee000000000003"):
        await a.insert_job(new_job(job_id, tracks=1))
    x, y = "eeee000000000002", "eeee000000000003"
    await a.mark_started(x, 1.0, [event(x, "start"), event(x, "track")])
    await a.mark_started(y, 1.0, [event(y, "start")])
    first, second = await asyncio.gather(ids_claimed(a, "A"), ids_claimed(b, "B"))
    assert sorted(first + second) == [f"evt_{x}_start_0", f"evt_{y}_start_0"]  # each once; x's track waits
    assert await ids_claimed(a, "A") == []
    assert await ids_claimed(b, "B") == []
    await a.outbox.release("A")
    await b.outbox.release("B")  # both restart: their claims end
    batch = await b.outbox.claim("B", 10, 60)
    x_start = next(d for d in batch if d.event.job_id == x)
    await b.outbox.delivered(x_start.row)
    assert await ids_claimed(a, "A") == [f"evt_{x}_track_0"]


@store_test
async def test_a_failed_try_waits_its_turn_and_a_given_up_event_lets_the_next_go(a: JobStore, b: JobStore):
    x = "eeee000000000004"
    await a.insert_job(new_job(x, tracks=1))
    await a.mark_started(x, 1.0, [event(x, "start"), event(x, "completed")])
    (d,) = await a.outbox.claim("A", 10, 0.05)
    await asyncio.sleep(0.3)
    (lapsed,) = await b.outbox.claim("B", 10, 60)  # A's claim lapsed (A died mid-try): B has it, same id
    assert lapsed.event.event_id == d.event.event_id
    assert lapsed.attempts == 0
    await b.outbox.failed(lapsed.row, "B", "answered 500", 0.2)
    assert await ids_claimed(a, "A") == []  # not due yet, and the job's next event waits behind it
    await a.outbox.failed(d.row, "A", "A's late outcome", None)  # not A's claim any more: changes nothing
    await asyncio.sleep(0.4)
    (again,) = await a.outbox.claim("A", 10, 60)
    assert again.event.event_id == d.event.event_id
    assert again.attempts == 1
    await a.outbox.failed(again.row, "A", "answered 500", None)  # given up
    assert await ids_claimed(b, "B") == [f"evt_{x}_completed_0"]
    assert (await a.outbox.stats()).depth == 1
    assert await a.outbox.sweep(time.time() + 3600) == 1  # the given-up row, once old enough


@store_test
async def test_progress_events_are_one_per_job_in_the_gap_and_none_after_its_end(a: JobStore, b: JobStore):
    x = "eeee000000000005"
    job = new_job(x, tracks=1)
    await a.insert_job(job)
    assert await a.outbox.add_progress(event(x, "progress", 0), 60)
    assert not await b.outbox.add_progress(event(x, "progress", 1), 60)
    assert await b.outbox.add_progress(event(x, "progress", 2), 0)
    t = job.tracks[0]
    await a.save_track(dataclasses.replace(t, status=TrackStatus.cancelled), (TrackStatus.queued, None))
    assert await a.finish_job(x, time.time())
    assert not await a.outbox.add_progress(event(x, "progress", 3), 0)


@store_test
async def test_a_quota_admits_each_track_once_across_dispatchers(a: JobStore, b: JobStore):
    quota = Quota("studio", tracks_per_hour=2)

    async def submit(store: JobStore, n: int) -> OverQuota | None:
        job = dataclasses.replace(new_job(f"eeee00000000010{n}", tracks=1), caller="studio")
        try:
            await store.insert_job(job, quota)
        except OverQuota as over:
            return over
        return None

    refused = await asyncio.gather(*(submit(s, n) for n, s in enumerate([a, b, a, b, a, b])))
    assert sum(r is None for r in refused) == 2
    assert {(r.limit, r.retry_after > 0) for r in refused if r is not None} == {("tracks_per_hour", True)}
    use = await b.usage("studio", time.time() - WINDOW_SEC)
    assert (use.tracks, use.active_jobs) == (2, 2)
    other = dataclasses.replace(new_job("eeee000000000200", tracks=1), caller="other")
    await a.insert_job(other, Quota("other", tracks_per_hour=2))
    with pytest.raises(OverQuota) as over:
        await a.insert_job(dataclasses.replace(new_job("eeee000000000201"), caller="x"), Quota("x", concurrent_jobs=0))
    assert over.value.limit == "concurrent_jobs"


# ---- the service: events to a real receiver, the wait mode, keys ---------------------------------


def body(**extra: Any) -> GenerateRequest:
    return GenerateRequest(**{"lyrics": "hello", "duration": 0.05, "num_tracks": 1, "seed": 5, **extra})


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@aio
async def test_a_jobs_events_arrive_signed_in_order(tmp_path):
    with Receiver() as rx:
        async with FakeFleet(tmp_path, **HOOKS) as f:
            kinds = ["start", "track", "completed"]
            job_id = (await f.svc.submit(body(num_tracks=2, webhook=rx.url, webhook_events=kinds))).job_id
            await until(lambda: bool(rx.events("completed")), timeout=30)
        hits = rx.events()
        assert [h.event["type"] for h in hits] == ["start", "track", "track", "completed"]
        assert sorted(h.event["track"] for h in hits if h.event["type"] == "track") == [0, 1]
        assert len({h.id for h in hits}) == 4
        for h in hits:
            assert h.event["data"]["job_id"] == job_id
            assert verify(SECRET, h.headers, h.body)
            assert not verify("whsec_" + "QUJD" * 8, h.headers, h.body)
        assert hits[-1].event["data"]["status"] == "completed"


@aio
async def test_a_running_track_sends_progress_events_between_start_and_completed(tmp_path):
    with Receiver() as rx:
        async with FakeFleet(tmp_path, **HOOKS) as f:
            w, hold = f.workers[0], asyncio.Event()
            w.plans.append(Plan(release=hold))
            kinds = ["start", "progress", "completed"]
            await f.svc.submit(body(webhook=rx.url, webhook_events=kinds))
            w.phase, w.detail = "backbone", "10/100 tokens"
            for pct in range(1, 100):  # the worker moves on; the health poll shows each step
                w.progress = pct
                await asyncio.sleep(0.01)
                if rx.events("progress"):
                    break
            await until(lambda: bool(rx.events("progress")), timeout=30)
            hold.set()
            await until(lambda: bool(rx.events("completed")), timeout=30)
        types = [h.event["type"] for h in rx.events()]
        assert types[0] == "start"
        assert types[-1] == "completed"
        assert "progress" in types
        progress = rx.events("progress")[0].event["data"]
        assert progress["status"] == "generating"
        assert progress["tracks"][0]["progress"] > 0


@aio
async def test_a_receiver_failing_twice_gets_the_event_three_times_with_one_id(tmp_path):
    with Receiver() as rx:
        rx.answers.extend([500, 500])
        async with FakeFleet(tmp_path, **HOOKS) as f:
            await f.svc.submit(body(webhook=rx.url))
            await until(lambda: len(rx.hits) == 3, timeout=30)
            await until(
                lambda: (
                    metric(f.parts.readings.metrics().decode(), 'songserve_webhook_deliveries_total{event="completed"}')
                    == 1
                )
            )
            text = f.parts.readings.metrics().decode()
        assert len({h.id for h in rx.hits}) == 1
        assert [h.event["type"] for h in rx.hits] == ["completed"] * 3
        assert metric(text, 'songserve_webhook_failures_total{reason="status"}') == 2
        assert "songserve_webhook_outbox_depth" in text
        assert "songserve_webhook_oldest_event_seconds" in text


@aio
async def test_a_slow_receiver_times_out_and_the_event_is_tried_again(tmp_path):
    with Receiver() as rx:
        rx.delays.append(3.0)
        async with FakeFleet(tmp_path, **HOOKS, webhook_timeout_sec=0.3) as f:
            await f.svc.submit(body(webhook=rx.url))
            done = 'songserve_webhook_deliveries_total{event="completed"}'
            await until(lambda: metric(f.parts.readings.metrics().decode(), done) == 1, timeout=30)
            assert (
                metric(f.parts.readings.metrics().decode(), 'songserve_webhook_failures_total{reason="timeout"}') == 1
            )
        assert len({h.id for h in rx.hits}) == 1
        assert len(rx.hits) == 2


@aio
async def test_an_event_never_answered_2xx_is_given_up_after_the_limit(tmp_path):
    with Receiver(default=503) as rx:
        async with FakeFleet(tmp_path, **HOOKS, webhook_max_age_sec=0.3) as f:
            view = await f.svc.submit(body(webhook=rx.url))
            await until(
                lambda: metric(f.parts.readings.metrics().decode(), "songserve_webhook_given_up_total") == 1, timeout=30
            )
            assert (await f.svc.view(view.job_id)).status == "completed"  # the job never waited on it


@aio
async def test_a_private_url_is_refused_at_submit_naming_webhook_unless_allowed(tmp_path):
    async with FakeFleet(tmp_path, webhook_secret=SECRET) as f:
        with pytest.raises(FieldError) as err:
            await f.svc.submit(body(webhook="http://127.0.0.1:8080/hook"))
        assert err.value.detail == [
            {"loc": ["body", "webhook"], "msg": err.value.detail[0]["msg"], "type": "value_error"}
        ]
        assert "127.0.0.1 is a loopback address that WEBHOOK_ALLOW does not allow" in str(err.value)
        with pytest.raises(FieldError, match="10.0.0.7 is a private address"):
            await f.svc.submit(body(webhook="http://10.0.0.7/hook"))
    async with FakeFleet(tmp_path / "2", webhook_secret=SECRET, webhook_allow="127.0.0.1/32") as f:
        await f.svc.submit(body(webhook="http://127.0.0.1:8080/hook"))
    async with FakeFleet(tmp_path / "3", webhook_allow="127.0.0.1/32") as f:
        with pytest.raises(FieldError, match="WEBHOOK_SECRET"):
            await f.svc.submit(body(webhook="http://127.0.0.1:8080/hook"))
    for bad, why in [("ftp://x/y", "http"), ("http://u:p@x/y", "user or password"), ("http://x:99999/", "port")]:
        with pytest.raises(ValidationError, match=why):
            body(webhook=bad)
    with pytest.raises(ValidationError, match="needs a webhook"):
        body(webhook_events=["track"])


@aio
async def test_the_wait_answers_the_ended_job_or_nothing_at_its_deadline(tmp_path):
    async with FakeFleet(tmp_path) as f:
        hold = asyncio.Event()
        f.workers[0].plans.append(Plan(release=hold))
        job_id = (await f.svc.submit(body())).job_id
        assert await f.svc.wait_for_end(job_id, 0.2) is None
        hold.set()
        view = await f.svc.wait_for_end(job_id, 30)
        assert view is not None
        assert view.status == "completed"


@aio
async def test_a_key_over_its_hourly_tracks_gets_429_another_key_does_not_and_usage_survives_a_restart(tmp_path):
    studio, other = Caller("studio", KeyLimits(tracks_per_hour=2)), Caller("other", KeyLimits(tracks_per_hour=2))
    async with FakeFleet(tmp_path) as f:
        for _ in range(2):
            await f.svc.submit(body(), caller=studio)
        with pytest.raises(OverLimit) as over:
            await f.svc.submit(body(), caller=studio)
        assert over.value.http_status == 429
        assert 3000 < int(over.value.headers["Retry-After"]) <= 3600
        assert over.value.extra == {"limit": {"name": "tracks_per_hour", "value": 2, "used": 2}}
        await f.svc.submit(body(), caller=other)
        use = await f.parts.usage.view(studio)
        assert (use.name, use.tracks_last_hour, use.tracks_left) == ("studio", 2, 0)
    restarted = f.new_service()  # the same store file: a dispatcher's restart
    try:
        use = await f.parts.usage.view(studio)  # the restarted dispatcher's parts
        assert (use.tracks_last_hour, use.tracks_left) == (2, 0)
        assert use.next_track_in_sec > 3000
        with pytest.raises(OverLimit):
            await restarted.submit(body(), caller=studio)
    finally:
        await restarted.store.close()


@aio
async def test_a_request_larger_than_its_key_allows_is_refused_naming_the_field(tmp_path):
    small = Caller("small", KeyLimits(max_duration=0.1, max_priority=3, tracks_per_hour=2, concurrent_jobs=1))
    async with FakeFleet(tmp_path) as f:
        for extra, field in [
            ({"duration": 0.5}, "duration"),
            ({"priority": 5}, "priority"),
            ({"num_tracks": 3}, "num_tracks"),
        ]:
            with pytest.raises(FieldError) as err:
                await f.svc.submit(body(**extra), caller=small)
            assert err.value.detail[0]["loc"] == ["body", field]
            assert "the key 'small'," in str(err.value)  # quoted once, no "'small''s"
            assert "''" not in str(err.value)
        hold = asyncio.Event()
        f.workers[0].plans.append(Plan(release=hold))
        await f.svc.submit(body(), caller=small)
        with pytest.raises(OverLimit, match="concurrent_jobs"):
            await f.svc.submit(body(), caller=small)
        hold.set()


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--webhook-secret", "whsec_not base64!", "Setting webhook_secret: a whsec_ secret must be followed by base64"),
        ("--webhook-allow", "no such!", "Setting webhook_allow: 'no such!' is neither a host name"),
    ],
)
def test_a_bad_webhook_setting_refuses_start_up_naming_it(tmp_path, capsys, flag, value, said):
    from songserve.api.main import main

    assert main(["--port", "1", "--state-dir", str(tmp_path), flag, value]) == 2
    assert said in capsys.readouterr().err
