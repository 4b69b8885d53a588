import torch
from megamoe_torch import timing


def test_host_time_is_the_median_round_not_the_slow_one(monkeypatch):
    """Rounds of `calls` calls: a round that something else on the host slows down does not move
    the answer (the median of the rounds), and every call is counted."""
    clock = {"now": 0.0, "calls": 0}

    def call():
        clock["calls"] += 1
        # one warm-up call, then rounds of 10: the calls of the third round cost 50 ms, the
        # others 1 ms
        slow = 1 + 2 * 10 < clock["calls"] <= 1 + 3 * 10
        clock["now"] += 0.050 if slow else 0.001

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])
    seconds = timing.host_seconds_per_call(call, device=torch.device("cpu"), calls=10, rounds=5)
    assert clock["calls"] == 1 + 5 * 10
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
