import torch
from megamoe_torch import timing


def test_host_time_is_the_median_single_call_not_the_slow_ones(monkeypatch):
    """Single calls, each timed on its own: calls that something else on the host slows down do
    not move the answer (the median), and every round makes one call."""
    clock = {"now": 0.0, "calls": 0}

    def call():
        clock["calls"] += 1
        # one warm-up call, then 7 rounds: the third and fifth calls cost 50 ms, the others 1 ms
        slow = clock["calls"] in (1 + 3, 1 + 5)
        clock["now"] += 0.050 if slow else 0.001

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])
    seconds = timing.host_seconds_per_call(call, device=torch.device("cpu"), rounds=7)
    assert clock["calls"] == 1 + 7
    assert abs(seconds - 0.001) < 1e-9


def test_keep_busy_calls_until_the_time_has_passed_and_at_least_once(monkeypatch):
    """The settle step before timing: calls go on until `seconds` of wall time have passed (each
    call here takes 30 ms, so 0.1 s takes four), and a zero budget still makes one call."""
    clock = {"now": 0.0, "calls": 0}

    def call():
        clock["calls"] += 1
        clock["now"] += 0.030

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])
    assert timing.keep_busy(call, device=torch.device("cpu"), seconds=0.1) == 4
    assert clock["calls"] == 4
    assert timing.keep_busy(call, device=torch.device("cpu"), seconds=0.0) == 1
