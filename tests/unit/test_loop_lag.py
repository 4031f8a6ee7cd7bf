"""The event loop's lag probe (``songserve/api/loop_lag.py``): its arithmetic on a clock of the test's own,
and its export on ``/metrics``."""

from __future__ import annotations

import asyncio

import pytest

from songserve.api.loop_lag import LagWindow, LoopLag, overshoot
from songserve.api.metrics import DispatcherMetrics

pytestmark = pytest.mark.quick


def test_the_overshoot_is_how_much_later_than_the_interval_the_loop_woke():
    assert overshoot(10.0, 10.1, 0.1) == 0.0
    assert overshoot(10.0, 12.2, 0.1) == pytest.approx(2.1)
    assert overshoot(10.0, 10.05, 0.1) == 0.0  # a clock that woke early is not a negative lag


def test_the_window_keeps_the_worst_lag_until_it_is_older_than_the_window():
    w = LagWindow(window=60.0)
    assert w.worst(0.0) == 0.0
    w.record(1.0, 0.002)
    w.record(2.0, 2.5)  # a burst
    w.record(3.0, 0.001)
    assert w.worst(3.0) == 2.5
    assert w.worst(61.9) == 2.5
    assert w.worst(62.1) == 0.001  # the burst is a minute old: the worst since is the small one
    assert w.worst(200.0) == 0.0
    assert w.count == 3


def test_a_later_larger_lag_replaces_the_smaller_ones_before_it():
    w = LagWindow(window=10.0)
    for t, lag in [(0.0, 0.3), (1.0, 0.1), (2.0, 0.2), (3.0, 0.5), (4.0, 0.05)]:
        w.record(t, lag)
    assert w.worst(4.0) == 0.5
    assert w.worst(13.5) == 0.05  # 0.5 (at 3.0) has gone; 0.05 (at 4.0) is left


def test_a_probe_is_recorded_in_the_window_and_observed():
    seen: list[float] = []
    now = [100.0]
    lag = LoopLag(seen.append, interval=0.1, window=60.0, clock=lambda: now[0])
    assert lag.note(100.0, 100.1) == 0.0
    now[0] = 102.0
    assert lag.note(100.2, 102.0) == pytest.approx(1.7)
    assert seen == [0.0, pytest.approx(1.7)]
    assert lag.worst() == pytest.approx(1.7)
    now[0] = 170.0
    assert lag.worst() == 0.0


def test_the_lag_is_a_histogram_and_a_worst_of_the_window_on_metrics():
    m = DispatcherMetrics()
    now = [50.0]
    lag = LoopLag(m.loop_lag.observe, interval=0.1, clock=lambda: now[0])
    m.watch_loop_lag(lag.worst)
    lag.note(49.0, 50.0)  # 0.9 s late
    text = m.render().decode()
    assert "songserve_event_loop_lag_seconds_count 1.0" in text
    assert 'songserve_event_loop_lag_seconds_bucket{le="1.0"} 1.0' in text
    assert 'songserve_event_loop_lag_seconds_bucket{le="0.5"} 0.0' in text
    assert "songserve_event_loop_lag_max_seconds 0.9" in text


def test_the_probe_task_records_while_it_runs_and_stops():
    async def go() -> int:
        lag = LoopLag(interval=0.001)
        lag.start()
        while lag.window.count < 3:  # visible state, not a sleep of a guessed length
            await asyncio.sleep(0.001)
        await lag.stop()
        return lag.window.count

    assert asyncio.run(go()) >= 3
