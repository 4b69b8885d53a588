"""MegaMoEConfig(knobs="auto"): the layer tunes its expert GEMMs at the first forward of a batch
class and stores the winner in the knob cache; knobs="lookup" never measures. Across ranks the
tuner times in lockstep and every rank stores the candidate whose slowest rank is fastest.

On a CPU the expert backend is a stand-in with knobs (it computes with the reference backend,
whatever the knobs) and the timer reads each candidate's time from a table, different per rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts import ReferenceExperts
from megamoe_runtime.tuning import KnobCache
from megamoe_runtime.tuning import online as online_tuning
from megamoe_runtime.tuning.cache import ENVIRONMENT_VARIABLE, KnobKey
from megamoe_runtime.tuning.expert_knobs import (
    batch_gemm_key,
    cache_fields,
    gemm_candidates,
    knobs_from_cache,
    looked_up_knobs,
)
from megamoe_runtime.tuning.online import OnlineAutotuner
from megamoe_runtime.weights import Unquantized
from megamoe_torch import MegaMoE, MegaMoEConfig
from megamoe_torch import layer as layer_module

OPS = ("gate_up", "down")
CANDIDATES = {op: gemm_candidates(op, quick=True, same_numbers=True)[:4] for op in OPS}
# seconds per candidate on each rank: alone, rank 0 would take candidate 0 of each op and rank 1
# candidate 1; the slowest rank is fastest with candidate 2 (gate-up: max 4, 5, 3, 6) and
# candidate 3 (down: max 5, 4, 6, 2)
RANK_TIMES = [
    {"gate_up": [1.0, 5.0, 3.0, 4.0], "down": [1.0, 4.0, 6.0, 2.0]},
    {"gate_up": [4.0, 1.0, 2.0, 6.0], "down": [5.0, 1.0, 3.0, 2.0]},
]
COLLECTIVE_WINNER = {"gate_up": CANDIDATES["gate_up"][2], "down": CANDIDATES["down"][3]}


class StandInExperts:
    """A backend with knobs: the reference MLP, whatever the knobs. `looked_up` holds the knobs
    its last call looked up (what a real backend would run)."""

    name = "stand_in"
    supports_autograd = False

    def __init__(self, knob_cache: KnobCache | None = None):
        self.knob_cache = KnobCache() if knob_cache is None else knob_cache
        self.reference = ReferenceExperts()
        self.looked_up: dict | None = None

    @staticmethod
    def _weight_dims(prepared) -> dict[str, tuple[int, int]]:
        hidden, intermediate = prepared.hidden_size, prepared.intermediate_size
        return {"gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}

    def knob_keys(self, batch, prepared):
        return {
            op: batch_gemm_key(op, batch, weight_dims=dims)
            for op, dims in self._weight_dims(prepared).items()
        }

    def knob_candidates(self, op, batch, prepared):
        return list(CANDIDATES[op])

    def expert_runner(self, batch, prepared, *, knobs):
        return lambda: self.reference(batch, prepared)

    def forget_launchers(self) -> None:
        pass

    def prepare(self, weights):
        return self.reference.prepare(weights)  # FP8 weights: the values they stand for

    def __call__(self, batch, prepared, *, row_scale_M=None):
        self.looked_up = {
            op: looked_up_knobs(self.knob_cache, key)
            for op, key in self.knob_keys(batch, prepared).items()
        }
        return self.reference(batch, prepared, row_scale_M=row_scale_M)


class TableTimer:
    def __init__(self, times: dict[str, list[float]]):
        self.times = times
        self.timed: list[tuple[str, object]] = []

    def __call__(self, trial) -> float:
        trial.run()
        self.timed.append((trial.op, trial.knobs))
        return self.times[trial.op][CANDIDATES[trial.op].index(trial.knobs)]


class StandIns:
    """Layers built inside the block get a StandInExperts backend and time with `timer`; the
    knob cache is `cache_path` ($MEGAMOE_KNOB_CACHE). Restores all three on exit (under torchrun
    the process runs other tests after)."""

    def __init__(self, timer: TableTimer, cache_path: Path):
        self.timer, self.cache_path = timer, cache_path

    def __enter__(self):
        self.saved = (
            layer_module.make_backend,
            online_tuning.replay_seconds,
            os.environ.get(ENVIRONMENT_VARIABLE),
        )
        layer_module.make_backend = lambda name, **options: StandInExperts()
        online_tuning.replay_seconds = self.timer
        os.environ[ENVIRONMENT_VARIABLE] = str(self.cache_path)
        return self

    def __exit__(self, *exc):
        layer_module.make_backend, online_tuning.replay_seconds, saved_path = self.saved
        if saved_path is None:
            os.environ.pop(ENVIRONMENT_VARIABLE, None)
        else:
            os.environ[ENVIRONMENT_VARIABLE] = saved_path


def layer_config(knobs: str, **overrides) -> MegaMoEConfig:
    fields = dict(
        hidden_size=64,
        intermediate_size=32,
        num_experts=8,
        top_k=2,
        backend="reference",
        knobs=knobs,
    )
    fields.update(overrides)
    return MegaMoEConfig(**fields)


def test_auto_tunes_at_the_first_forward_and_later_processes_look_it_up(tmp_path):
    cache_path = tmp_path / "knobs.json"
    timer = TableTimer(RANK_TIMES[1])  # alone: candidate 1 of each op is the fastest
    winners = {op: CANDIDATES[op][1] for op in OPS}
    x = torch.randn(24, 64)
    with StandIns(timer, cache_path), torch.no_grad():
        torch.manual_seed(0)
        tuned = MegaMoE(layer_config("auto"))
        y = tuned(x)
        assert timer.timed == [(op, knobs) for op in OPS for knobs in CANDIDATES[op]]
        assert tuned._expert_backend.looked_up == winners  # this forward already runs them
        tuned(x)  # the same class: looked up, not timed
        tuned(torch.randn(26, 64))  # 26 x 2 rows over 8 experts: the same class again
        assert len(timer.timed) == 8
        # the next process: a fresh layer finds the winners in the knob cache
        torch.manual_seed(0)
        fresh = MegaMoE(layer_config("auto"))
        torch.testing.assert_close(fresh(x), y, rtol=0, atol=0)
        assert len(timer.timed) == 8
        assert fresh._expert_backend.looked_up == winners
    # the numbers are those of a layer that never tunes
    torch.manual_seed(0)
    plain = MegaMoE(layer_config("lookup"))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), y, rtol=0, atol=0)


def test_auto_tunes_a_layer_of_fp8_experts_too(tmp_path):
    # the stand-in keys every layer under the bf16 ops; the cutedsl backend's FP8 keys are
    # checked in megamoe-runtime's test_online_autotune
    timer = TableTimer(RANK_TIMES[0])
    with StandIns(timer, tmp_path / "knobs.json"), torch.no_grad():
        layer = MegaMoE(layer_config("auto", weight_dtype="fp8", intermediate_size=128))
        layer(torch.randn(24, 64))
        assert timer.timed == [(op, knobs) for op in OPS for knobs in CANDIDATES[op]]
        assert layer._expert_backend.looked_up == {op: CANDIDATES[op][0] for op in OPS}


def test_lookup_never_measures(tmp_path):
    cache_path = tmp_path / "knobs.json"
    timer = TableTimer(RANK_TIMES[0])
    with StandIns(timer, cache_path), torch.no_grad():
        layer = MegaMoE(layer_config("lookup"))
        layer(torch.randn(24, 64))
        assert layer._expert_backend.looked_up == {op: None for op in OPS}
    assert timer.timed == [] and not cache_path.exists()


def test_unknown_knobs_mode_is_refused():
    with pytest.raises(ValueError, match=r"knobs must be one of \('lookup', 'auto'\), got 'fast'"):
        layer_config("fast")


# ---- across ranks -------------------------------------------------------------------------


def _rank_dir(root: str, rank: int) -> Path:
    path = Path(root) / f"rank{rank}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def tuner_picks_the_same_winner_on_every_rank(rank, world_size, device, root):
    """The tuner alone: rank 0's cache already holds the gate-up class, rank 1's does not, so
    both ops are tuned on every rank (no rank skips ahead into another collective)."""
    cache = KnobCache(_rank_dir(root, rank) / "knobs.json")
    backend = StandInExperts(cache)
    generator = torch.Generator().manual_seed(rank)
    rows_MH = torch.randn(48, 64, generator=generator).to(device)
    offsets = torch.tensor([0, 6, 12, 18, 24, 30, 36, 42, 48], dtype=torch.int32, device=device)
    batch = ExpertBatch(rows_MH=rows_MH, expert_offsets=offsets, valid_rows=48)
    weights = Unquantized(
        w13_E2IH=torch.randn(8, 64, 64, generator=generator).to(device),
        w2_EHI=torch.randn(8, 64, 32, generator=generator).to(device),
    )
    keys = backend.knob_keys(batch, weights)
    if rank == 0:
        cache.put(keys["gate_up"], cache_fields(CANDIDATES["gate_up"][0]), microseconds=1.0)
    timer = TableTimer(RANK_TIMES[rank % 2])
    tuner = OnlineAutotuner(process_group=dist.group.WORLD, seconds_of=timer)
    tuner.ensure_tuned(backend, batch, weights)
    tuner.ensure_tuned(backend, batch, weights)  # settled: no collective, no timing
    on_disk = KnobCache(cache.path)
    winners = {op: knobs_from_cache(on_disk, key) for op, key in keys.items()}
    every_rank = [None] * world_size
    dist.all_gather_object(every_rank, winners)
    # checked after the last collective, so one rank's failure cannot hang the others
    assert len(timer.timed) == 8
    assert every_rank == [COLLECTIVE_WINNER] * world_size


@pytest.mark.multirank
def test_ranks_tune_in_lockstep_and_store_the_same_winner(multirank, tmp_path):
    multirank(tuner_picks_the_same_winner_on_every_rank, str(tmp_path))


def expert_parallel_layer_tunes_in_lockstep(rank, world_size, device, root):
    """The expert-parallel layer (torch dispatcher): ranks receive different row counts, so
    their batches can be of different classes; every rank times the same candidates at the
    first forward and stores the collective winner under its own class. Later forwards, of any
    class, only look knobs up."""
    cache_path = _rank_dir(root, rank) / "knobs.json"
    timer = TableTimer(RANK_TIMES[rank % 2])
    generator = torch.Generator().manual_seed(rank)
    with StandIns(timer, cache_path), torch.no_grad():
        torch.manual_seed(3)  # the same router on every rank
        layer = MegaMoE(
            layer_config("auto", backend="auto", dispatcher="torch"),
            process_group=dist.group.WORLD,
            device=device,
        )
        for tokens in (40 if rank == 0 else 9, 5, 300):
            layer(torch.randn(tokens, 64, generator=generator).to(device))
    cache = KnobCache(cache_path)
    stored = {key.op: knobs_from_cache(cache, key) for key in _keys_of(cache.entries())}
    every_rank = [None] * world_size
    dist.all_gather_object(every_rank, stored)
    # checked after the last collective, so one rank's failure cannot hang the others
    assert len(timer.timed) == 8
    assert len(cache.entries()) == 2  # the first forward's class only
    assert every_rank == [COLLECTIVE_WINNER] * world_size


def _keys_of(entries: dict):
    for text in entries:
        op, device_name, dtype, n, k, bucket = text.split("|")
        yield KnobKey(op, device_name, dtype, int(n[1:]), int(k[1:]), int(bucket[1:]))


@pytest.mark.multirank
def test_expert_parallel_layer_tunes_in_lockstep(multirank, tmp_path):
    multirank(expert_parallel_layer_tunes_in_lockstep, str(tmp_path))
