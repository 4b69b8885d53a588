"""The online autotuner on a CPU: a stand-in backend with knobs (it computes with the reference
backend) and a stand-in timer that reads each candidate's time from a table."""

from dataclasses import replace

import torch
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.experts import ReferenceExperts
from megamoe_runtime.experts.cutedsl import CuteDSLExperts, CuteDSLFP8Weights, CuteDSLWeights
from megamoe_runtime.tuning import KnobCache, expert_knobs
from megamoe_runtime.tuning.expert_knobs import (
    batch_gemm_key,
    cache_fields,
    gemm_candidates,
    knobs_from_cache,
    with_the_numbers_of,
)
from megamoe_runtime.tuning.online import KnobTrial, OnlineAutotuner
from megamoe_runtime.weights import Unquantized

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 64, 32, 2
WEIGHT_DIMS = {"gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}
CANDIDATES = {op: gemm_candidates(op, quick=True, same_numbers=True)[:4] for op in WEIGHT_DIMS}


class StandInExperts:
    """A backend with knobs: the reference MLP, whatever the knobs. It records the knobs each
    runner was bound with and the knobs each call looked up, and refuses to "compile" `failing`."""

    name = "stand_in"
    supports_autograd = False

    def __init__(self, knob_cache: KnobCache, *, failing=()):
        self.knob_cache = knob_cache
        self.failing = set(failing)
        self.forgotten = 0
        self.looked_up = None
        self.reference = ReferenceExperts()

    def knob_keys(self, batch, prepared):
        return {op: batch_gemm_key(op, batch, weight_dims=dims) for op, dims in WEIGHT_DIMS.items()}

    def knob_candidates(self, op, batch, prepared):
        return list(CANDIDATES[op])

    def expert_runner(self, batch, prepared, *, knobs):
        if self.failing & set(knobs.values()):
            raise ValueError("these knobs do not compile")
        return lambda: self.reference(batch, prepared)

    def forget_launchers(self):
        self.forgotten += 1

    def prepare(self, weights):
        return weights

    def __call__(self, batch, prepared, *, row_scale_M=None):
        keys = self.knob_keys(batch, prepared)
        self.looked_up = {
            op: expert_knobs.looked_up_knobs(self.knob_cache, k) for op, k in keys.items()
        }
        return self.reference(batch, prepared, row_scale_M=row_scale_M)


class TableTimer:
    """Seconds per candidate from `table[op][index in CANDIDATES[op]]`; runs each trial once
    (so a trial's runner really computes) and records what it timed."""

    def __init__(self, table):
        self.table = table
        self.timed: list[tuple[str, object]] = []

    def __call__(self, trial: KnobTrial) -> float:
        assert trial.key.op == trial.op
        trial.run()
        self.timed.append((trial.op, trial.knobs))
        return self.table[trial.op][CANDIDATES[trial.op].index(trial.knobs)]


def make_problem(tokens: int, *, seed: int = 0, capacity: int | None = None):
    generator = torch.Generator().manual_seed(seed)
    x_TH = torch.randn(tokens, HIDDEN, generator=generator)
    ids_TK = torch.argsort(torch.rand(tokens, EXPERTS, generator=generator), dim=1)[:, :TOP_K]
    weights_TK = torch.rand(tokens, TOP_K, generator=generator)
    batch, _ = LocalDispatcher(EXPERTS, capacity=capacity).dispatch(x_TH, ids_TK, weights_TK)
    weights = Unquantized(
        w13_E2IH=torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator),
        w2_EHI=torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator),
    )
    return batch, weights


TIMES = {"gate_up": [3.0, 1.0, 2.0, 4.0], "down": [2.0, 3.0, 4.0, 1.0]}


def test_the_fastest_is_stored_and_later_calls_and_processes_only_look_it_up(tmp_path):
    batch, weights = make_problem(24)
    backend = StandInExperts(KnobCache(tmp_path / "knobs.json"))
    timer = TableTimer(TIMES)
    tuner = OnlineAutotuner(seconds_of=timer)
    tuner.ensure_tuned(backend, batch, weights)
    # every candidate of both ops, gate-up first, each once
    assert timer.timed == [(op, knobs) for op in ("gate_up", "down") for knobs in CANDIDATES[op]]
    on_disk = KnobCache(tmp_path / "knobs.json")
    keys = backend.knob_keys(batch, weights)
    assert knobs_from_cache(on_disk, keys["gate_up"]) == CANDIDATES["gate_up"][1]
    assert knobs_from_cache(on_disk, keys["down"]) == CANDIDATES["down"][3]
    assert backend.forgotten == 1  # re-binds, so the next call runs the winners
    backend(batch, weights)
    assert backend.looked_up == {"gate_up": CANDIDATES["gate_up"][1], "down": CANDIDATES["down"][3]}

    tuner.ensure_tuned(backend, batch, weights)
    # another batch of the same class (24 and 26 tokens x 2 over 8 experts: 8 rows per expert)
    other, _ = make_problem(26, seed=1)
    tuner.ensure_tuned(backend, other, weights)
    # the next process: a fresh tuner and backend find the entries on disk
    OnlineAutotuner(seconds_of=timer).ensure_tuned(
        StandInExperts(KnobCache(tmp_path / "knobs.json")), batch, weights
    )
    assert len(timer.timed) == 8 and backend.forgotten == 1


def test_a_new_class_is_tuned_when_it_first_arrives(tmp_path):
    backend = StandInExperts(KnobCache(tmp_path / "knobs.json"))
    timer = TableTimer(TIMES)
    tuner = OnlineAutotuner(seconds_of=timer)
    small, weights = make_problem(4)
    large, _ = make_problem(256)
    tuner.ensure_tuned(backend, small, weights)
    tuner.ensure_tuned(backend, large, weights)
    assert len(timer.timed) == 16
    small_key, large_key = (backend.knob_keys(b, weights)["down"] for b in (small, large))
    assert small_key != large_key
    assert all(
        knobs_from_cache(backend.knob_cache, k) == CANDIDATES["down"][3]
        for k in (small_key, large_key)
    )


def test_a_candidate_that_fails_loses(tmp_path):
    batch, weights = make_problem(24)
    fastest = CANDIDATES["gate_up"][1]
    backend = StandInExperts(KnobCache(tmp_path / "knobs.json"), failing={fastest})
    timer = TableTimer(TIMES)
    OnlineAutotuner(seconds_of=timer).ensure_tuned(backend, batch, weights)
    assert ("gate_up", fastest) not in timer.timed
    key = backend.knob_keys(batch, weights)["gate_up"]
    assert knobs_from_cache(backend.knob_cache, key) == CANDIDATES["gate_up"][2]


def test_only_the_ops_without_an_entry_are_tuned(tmp_path, monkeypatch):
    batch, weights = make_problem(24)
    users, shipped = KnobCache(tmp_path / "knobs.json"), KnobCache(tmp_path / "shipped.json")
    backend = StandInExperts(users)
    keys = backend.knob_keys(batch, weights)
    shipped.put(keys["gate_up"], cache_fields(CANDIDATES["gate_up"][0]), microseconds=1.0)
    monkeypatch.setattr(expert_knobs, "shipped_knob_cache", lambda: shipped)
    timer = TableTimer(TIMES)
    OnlineAutotuner(seconds_of=timer).ensure_tuned(backend, batch, weights)
    assert {op for op, _ in timer.timed} == {"down"}
    assert users.get(keys["gate_up"]) is None  # the shipped entry stays where it is
    assert knobs_from_cache(users, keys["down"]) == CANDIDATES["down"][3]
    # both held: nothing to time, nothing to re-bind
    again = StandInExperts(KnobCache(tmp_path / "knobs.json"))
    OnlineAutotuner(seconds_of=timer).ensure_tuned(again, batch, weights)
    assert len(timer.timed) == 4 and again.forgotten == 0


def test_backends_without_knobs_and_empty_batches_are_left_alone(tmp_path):
    batch, weights = make_problem(24)
    timer = TableTimer(TIMES)
    OnlineAutotuner(seconds_of=timer).ensure_tuned(ReferenceExperts(), batch, weights)
    empty, _ = make_problem(0)
    backend = StandInExperts(KnobCache(tmp_path / "knobs.json"))
    OnlineAutotuner(seconds_of=timer).ensure_tuned(backend, empty, weights)
    assert timer.timed == [] and not (tmp_path / "knobs.json").exists()


def test_the_default_timer_times_the_runner(tmp_path):
    # on a CPU it times each runner by the host clock; some candidate is stored for each op
    batch, weights = make_problem(16)
    backend = StandInExperts(KnobCache(tmp_path / "knobs.json"))
    OnlineAutotuner().ensure_tuned(backend, batch, weights)
    for op, key in backend.knob_keys(batch, weights).items():
        assert knobs_from_cache(backend.knob_cache, key) in CANDIDATES[op]


def test_the_cutedsl_backend_keys_and_binds_what_the_tuner_stores(tmp_path):
    # what CuteDSLExperts gives the tuner, checked without a GPU: the classes it looks knobs up
    # by (only for ops without explicit knobs), and tuned knobs in place of the looked-up ones
    batch, weights = make_problem(24)
    prepared = CuteDSLWeights(w13=torch.empty(0), w2_EHI=weights.w2_EHI)
    cache = KnobCache(tmp_path / "knobs.json")
    backend = CuteDSLExperts(knob_cache=cache)
    keys = backend.knob_keys(batch, prepared)
    assert keys == {
        op: batch_gemm_key(op, batch, weight_dims=WEIGHT_DIMS[op]) for op in WEIGHT_DIMS
    }
    down_only = CuteDSLExperts(gate_up_knobs=CANDIDATES["gate_up"][0], knob_cache=cache)
    assert list(down_only.knob_keys(batch, prepared)) == ["down"]

    trial = CANDIDATES["down"][2]
    _, down = backend._knob_arguments(batch, prepared, {"down": trial})
    assert down == {"tuned_knobs": trial}
    stored = CANDIDATES["down"][1]
    expert_knobs.store_tuned(cache, keys["down"], stored, seconds=1e-3)
    _, down = backend._knob_arguments(batch, prepared)
    assert down == {"tuned_knobs": stored}
    backend._launchers[("a class",)] = None
    backend.forget_launchers()
    assert backend._launchers == {}


def test_the_cutedsl_backend_keys_fp8_weights_under_the_fp8_ops(tmp_path):
    # FP8 weights run the FP8 GEMMs: their knobs are looked up, tuned and stored under
    # gate_up_fp8 / down_fp8 (their own candidates and limits), explicit knobs apply to them too
    batch, weights = make_problem(24)
    empty = torch.empty(0)
    prepared = CuteDSLFP8Weights(
        w13=empty, w13_scales=empty, w2_EHI=weights.w2_EHI, w2_scales=empty
    )
    fp8_dims = {"gate_up_fp8": WEIGHT_DIMS["gate_up"], "down_fp8": WEIGHT_DIMS["down"]}
    cache = KnobCache(tmp_path / "knobs.json")
    backend = CuteDSLExperts(knob_cache=cache)
    keys = backend.knob_keys(batch, prepared)
    assert keys == {op: batch_gemm_key(op, batch, weight_dims=fp8_dims[op]) for op in fp8_dims}
    candidates = gemm_candidates("down_fp8", quick=True, same_numbers=True)
    stored = candidates[-1]
    expert_knobs.store_tuned(cache, keys["down_fp8"], stored, seconds=1e-3)
    gate_up, down = backend._knob_arguments(batch, prepared)
    assert (gate_up, down) == ({"tuned_knobs": None}, {"tuned_knobs": stored})
    # an entry of the bf16 op is not the FP8 op's
    bf16_key = batch_gemm_key("down", batch, weight_dims=WEIGHT_DIMS["down"])
    assert knobs_from_cache(cache, bf16_key) is None
    explicit = gemm_candidates("gate_up_fp8", quick=True, same_numbers=True)[0]
    pinned = CuteDSLExperts(gate_up_knobs=explicit, knob_cache=cache)
    assert list(pinned.knob_keys(batch, prepared)) == ["down_fp8"]
    assert pinned._knob_arguments(batch, prepared)[0] == {"knobs": explicit}


def test_online_candidates_keep_the_numbers():
    # no split-K (a sum in slices); every tile shape of the quick set otherwise
    def shape(knobs):
        return (knobs.tile_rows, knobs.tile_cols, knobs.swap_ab, knobs.pingpong, knobs.cluster)

    for op in WEIGHT_DIMS:
        online = gemm_candidates(op, quick=True, same_numbers=True)
        quick = gemm_candidates(op, quick=True)
        assert all(knobs.split_k == 1 for knobs in online)
        assert set(online) == {knobs for knobs in quick if knobs.split_k == 1}
        assert {shape(knobs) for knobs in online} == {shape(knobs) for knobs in quick}


def test_online_candidates_keep_a_split_defaults_slices():
    # one dsv3-ep8-local token: the default FP8 gate-up sums K in 4 slices; the candidates that
    # keep its numbers sum in the same 4 (swap-AB), or are the default again (prefill tiles
    # cannot split), in a list of the same length
    from megamoe_kernels import default_launches

    (split,) = default_launches("gate_up_fp8", 1, 32, weight_dims=(4096, 7168), sms=132)
    untuned = split.knobs
    assert untuned.split_k == 4
    whole = gemm_candidates("gate_up_fp8", quick=True, same_numbers=True)
    kept = with_the_numbers_of(untuned, whole)
    assert len(kept) == len(whole)
    for before, after in zip(whole, kept, strict=True):
        assert after == (replace(before, split_k=4) if before.swap_ab else untuned)
    # a default that sums K whole keeps the candidates as they are
    (plain,) = default_launches("gate_up_fp8", 8, 128, weight_dims=(1536, 2048), sms=132)
    assert plain.knobs.split_k == 1
    assert with_the_numbers_of(plain.knobs, whole) == whole


def test_a_fixed_capacity_is_one_class(tmp_path):
    # with a fixed capacity every batch is the same class, whatever it holds
    backend = StandInExperts(KnobCache(tmp_path / "knobs.json"))
    timer = TableTimer(TIMES)
    tuner = OnlineAutotuner(seconds_of=timer)
    for tokens in (3, 17, 32):
        batch, weights = make_problem(tokens, capacity=80)
        tuner.ensure_tuned(backend, batch, weights)
    assert len(timer.timed) == 8
