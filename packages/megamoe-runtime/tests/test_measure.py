"""The measurement harness on a CPU: the host clock, rounds, per-step timing, the writers."""

import csv

import pytest
import torch
from megamoe_runtime.measure import clock as timing
from megamoe_runtime.measure import gigabytes_per_second, speedup, tflops, write_csv


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


def test_step_times_drop_the_first_iterations_and_leave_the_barrier_out(monkeypatch):
    """Each step's median over the iterations after `skip`; what runs before each iteration (a
    barrier) is in no step's time."""
    clock = {"now": 0.0, "iteration": 0}
    costs = {"dispatch": [9.0, 0.2, 0.3, 0.1], "combine": [7.0, 0.5, 0.4, 0.6]}

    def step(name):
        def run():
            clock["now"] += costs[name][clock["iteration"]]

        return run

    steps = {"dispatch": step("dispatch"), "combine": step("combine")}
    calls = {"n": 0}

    def before_each():
        if calls["n"]:
            clock["iteration"] += 1
        calls["n"] += 1
        clock["now"] += 100.0  # a barrier that waits long

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])
    seconds = timing.median_step_seconds(
        steps, device=torch.device("cpu"), iterations=4, skip=1, before_each=before_each
    )
    assert seconds == pytest.approx({"dispatch": 0.2, "combine": 0.5})


def test_step_times_need_an_iteration_past_the_skipped_ones():
    with pytest.raises(ValueError, match="iterations"):
        timing.median_step_seconds(
            {"noop": lambda: None}, device=torch.device("cpu"), iterations=2, skip=2
        )


def test_alternating_rounds_interleave_the_candidates_and_keep_every_reading():
    order = []
    values = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 6.0])}

    def reader(name):
        def read():
            order.append(name)
            return next(values[name])

        return read

    readings = timing.alternating_readings({"a": reader("a"), "b": reader("b")}, rounds=3)
    assert order == ["a", "b"] * 3
    assert readings["a"].seconds == (3.0, 1.0, 2.0)
    assert readings["a"].best == 1.0 and readings["a"].median == 2.0
    assert readings["b"].spread == (6.0 - 4.0) / 4.0
    assert timing.Readings((3e-6, 1e-6, 2.5e-6)).median_and_range_us() == "2.5 (1.0-3.0)"


def test_csv_has_every_column_of_every_row_in_first_seen_order(tmp_path):
    path = tmp_path / "deeper" / "rows.csv"
    write_csv([{"tokens": 1, "us": 2.5}, {"tokens": 2, "us": 3.5, "error": "late"}], path)
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["tokens", "us", "error"]
    assert rows[0]["error"] == "" and rows[1]["error"] == "late"
    write_csv([], tmp_path / "none.csv")
    assert not (tmp_path / "none.csv").exists()


def test_rates_and_fractions():
    assert tflops(2e12, 0.5) == 4.0
    assert gigabytes_per_second(3e9, 1.5) == 2.0
    assert speedup(None, 1.0) is None and speedup(3.0, 1.5) == 2.0


def test_the_fp8_floor_counts_a_byte_a_weight_with_its_block_scales_and_fp8_products():
    """One token of qwen3-30b-a3b (8 rows on 8 experts): both floors are the weights' bytes at
    the HBM rate, the FP8 one a little over half the bf16 one (its scales, bf16 rows out). At
    8192 tokens both are the FLOPs' time, the FP8 one at the e4m3 rate."""
    from megamoe_runtime.geometries import (
        GEOMETRIES,
        H200_BF16_FLOPS,
        H200_FP8_FLOPS,
        H200_HBM_BYTES_PER_S,
        roofline_floor_seconds,
    )
    from megamoe_runtime.measure import expert_roofline_fraction

    qwen3 = GEOMETRIES["qwen3-30b-a3b"]
    h, i = qwen3.hidden_size, qwen3.intermediate_size
    weights = 8 * 3 * h * i
    fp8_decode = roofline_floor_seconds(qwen3, 8, 8, weight_dtype="fp8")
    assert fp8_decode * H200_HBM_BYTES_PER_S == pytest.approx(
        weights * (1 + 4 / 128**2) + 8 * (h + 2 * i + 2 * h)
    )
    assert 0.5 < fp8_decode / roofline_floor_seconds(qwen3, 8, 8) < 0.51
    rows = 8192 * 8
    assert roofline_floor_seconds(qwen3, rows, 128, weight_dtype="fp8") == pytest.approx(
        6 * rows * h * i / H200_FP8_FLOPS
    )
    assert roofline_floor_seconds(qwen3, rows, 128) == pytest.approx(
        6 * rows * h * i / H200_BF16_FLOPS
    )
    fraction = expert_roofline_fraction(
        qwen3, rows=8, active_experts=8, seconds=2 * fp8_decode, weight_dtype="fp8"
    )
    assert fraction == pytest.approx(0.5)


# stands in for nvidia-smi: checks the arguments it is given, prints two samples, a line of the
# wrong width and a sample whose power it could not read, then waits to be stopped
FAKE_SMI = """
import sys, time
assert sys.argv[1:] == ["--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                        "-lms", "20"], sys.argv
for line in ("1980, 300.5", "1500, 700.0", "garbage", "1400, [N/A]"):
    print(line, flush=True)
time.sleep(60)
"""


def test_smi_sampler_stamps_each_sample_and_reads_the_median_of_a_field():
    """Every well-formed line becomes a sample stamped with the host clock (a line of the wrong
    width is dropped); a field's median skips what is not a number; a span with no samples reads
    NaN; a field that is not sampled, or a program that is not there, is an error naming it."""
    import math
    import sys
    import time

    from megamoe_runtime.measure import SmiSampler

    start = time.time()
    with SmiSampler(
        ("clocks.sm", "power.draw"), period_ms=20, command=(sys.executable, "-c", FAKE_SMI)
    ) as sampler:
        deadline = time.time() + 30
        while len(sampler.samples) < 3 and time.time() < deadline:
            time.sleep(0.01)
    end = time.time()
    assert [values for _, values in sampler.samples] == [
        ("1980", "300.5"),
        ("1500", "700.0"),
        ("1400", "[N/A]"),
    ]
    assert all(start <= stamp <= end for stamp, _ in sampler.samples)
    assert sampler.median_of("clocks.sm", start, end) == 1500.0
    assert sampler.median_of("power.draw", start, end) == (300.5 + 700.0) / 2
    assert math.isnan(sampler.median_of("clocks.sm", end + 1, end + 2))
    # several spans (one candidate's readings among another's): the samples inside any of
    # them, each once
    sampler.samples = [
        (10.0, ("1980", "300.5")),
        (20.0, ("1500", "700.0")),
        (30.0, ("1400", "[N/A]")),
    ]
    around = [(9.0, 11.0), (29.0, 31.0), (10.0, 10.0)]
    assert sampler.median_over("clocks.sm", around) == (1980 + 1400) / 2
    assert sampler.median_over("power.draw", around) == 300.5
    assert math.isnan(sampler.median_over("clocks.sm", []))
    with pytest.raises(ValueError, match="'memory.used' is not sampled; sampled: clocks.sm"):
        sampler.median_of("memory.used", start, end)
    with pytest.raises(ValueError, match="period_ms must be >= 1, got 0"):
        SmiSampler(period_ms=0)
    with pytest.raises(RuntimeError, match="runs 'no-such-smi', which is not on this machine"):
        SmiSampler(command=("no-such-smi",))


def test_kernel_times_need_a_cuda_device_and_a_call():
    from megamoe_runtime.measure import kernel_times

    with pytest.raises(ValueError, match="kernels of a CUDA device, got device=cpu"):
        kernel_times(lambda: None, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="calls must be at least 1, got 0"):
        kernel_times(lambda: None, device="cuda", calls=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_times_count_each_kernel_per_call_after_one_unprofiled_run():
    """Three calls of two kernels each: a fill and an add, each launched once a call, the
    longer first; the function runs twice (once unprofiled)."""
    from megamoe_runtime.measure import kernel_times

    x, y = torch.zeros(1 << 24, device="cuda"), torch.empty(1 << 10, device="cuda")

    def calls():
        for _ in range(3):
            x.add_(1.0)
            y.fill_(2.0)

    kernels = kernel_times(calls, device="cuda", calls=3)
    assert torch.equal(x, torch.full_like(x, 6.0))
    assert len(kernels) == 2 and all(kernel.launches == 1.0 for kernel in kernels.values())
    times = [kernel.us for kernel in kernels.values()]
    assert times == sorted(times, reverse=True) and times[-1] > 0
    add, fill = kernels
    assert "add" in add.lower() and "fill" in fill.lower()
