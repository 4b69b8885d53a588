"""Online autotuning: a layer that tunes its expert GEMMs itself, once per batch class.

`OnlineAutotuner.ensure_tuned(backend, batch, prepared)` runs before the expert compute. The
first time it meets a batch class whose knobs neither the knob cache nor the shipped entries
hold, it times the backend's candidates for each GEMM of the class (the expert MLP with each
candidate in turn), stores the fastest in the knob cache and makes the backend bind its launchers
again, so this and every later process runs the winner and only looks it up. Under a process
group every rank times the same candidates in the same order, the times are reduced with MAX and
every rank stores the same winner (`pick_fastest`); whether to tune at all is decided together
too, so ranks whose caches differ still take the same path.

Backends without knobs (reference, grouped_mm) are left alone. A backend with knobs provides
(as `CuteDSLExperts` does):
    knob_cache                                 where winners are stored and looked up
    knob_keys(batch, prepared)                 {op: KnobKey} of the batch's class, in tuning order
    knob_candidates(op, batch, prepared)       the knobs to time, what runs untuned first
    expert_runner(batch, prepared, knobs=...)  a call of the expert MLP with some ops' knobs
    forget_launchers()                         re-bind, so a new cache entry takes effect
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.measure import (
    median_graph_replay_seconds,
    median_seconds,
    slowest_across_ranks,
)
from megamoe_runtime.tuning.autotune import pick_fastest
from megamoe_runtime.tuning.cache import KnobKey
from megamoe_runtime.tuning.expert_knobs import looked_up_knobs, store_tuned

# replays of the timing graph per candidate (10 calls each), as `megamoe tune` times
TIMED_REPEATS = 10


@dataclass(frozen=True)
class KnobTrial:
    """One candidate to time: the op it tunes, its knobs, the class key, and `run`, a call of
    the expert MLP with those knobs on the current batch (compiled, not yet run)."""

    op: str
    knobs: Any
    key: KnobKey
    run: Callable[[], object]
    device: torch.device


def replay_seconds(trial: KnobTrial) -> float:
    """The default timer: the median time of one call, replayed in a CUDA graph on a GPU (kernel
    time without launch gaps, after the GPU's clock settled: megamoe_runtime.measure), or by the
    host clock on a CPU."""
    if trial.device.type == "cuda":
        return median_graph_replay_seconds(trial.run, device=trial.device, repeats=TIMED_REPEATS)
    return median_seconds(trial.run, device=trial.device, repeats=TIMED_REPEATS)


def has_knobs(backend: object) -> bool:
    return callable(getattr(backend, "knob_keys", None))


class OnlineAutotuner:
    """Tunes a layer's expert GEMMs at run time; one per layer (its memo is per batch class of
    one layer's weights).

    process_group: the ranks of an expert-parallel layer, which tune in lockstep. Every rank
    must call `ensure_tuned` at the same forwards with the same backend. Under a group a backend
    is settled at its first forward only: later batches use what the cache holds, because ranks
    may meet new classes at different forwards (a torch.distributed receiver's capacity is the
    rows it received) and a decision taken alone would leave the others waiting.
    seconds_of: the timer of one KnobTrial (default `replay_seconds`)."""

    def __init__(
        self,
        *,
        process_group: torch.distributed.ProcessGroup | None = None,
        seconds_of: Callable[[KnobTrial], float] | None = None,
    ):
        self.process_group = process_group
        self.seconds_of = replay_seconds if seconds_of is None else seconds_of
        # what settle() has already handled: a later call of the same class costs this lookup
        self._settled: set[tuple] = set()

    def ensure_tuned(self, backend: Any, batch: ExpertBatch, prepared: Any) -> None:
        """Makes `backend` run tuned knobs for the batch's class: looked up when the knob cache
        (or the shipped entries) holds them, else tuned here, stored and bound. After the first
        call of a class it costs one set lookup."""
        if self.process_group is not None:
            memo = (backend.name,)
        else:
            rows = batch.capacity if batch.typical_rows is None else batch.typical_rows
            memo = (
                backend.name,
                rows,
                batch.num_experts,
                batch.hidden_size,
                batch.rows_MH.dtype,
                batch.rows_MH.device,
            )
        if memo in self._settled:
            return
        if has_knobs(backend):
            with torch.no_grad():
                self._settle(backend, batch, prepared)
        self._settled.add(memo)

    def _settle(self, backend: Any, batch: ExpertBatch, prepared: Any) -> None:
        keys = backend.knob_keys(batch, prepared)
        missing = [looked_up_knobs(backend.knob_cache, key) is None for key in keys.values()]
        if self.process_group is None and not any(missing):
            return
        _refuse_under_capture(batch)
        if self.process_group is not None:
            # tuned if any rank lacks the class: every rank takes the same path
            flags = slowest_across_ranks([float(flag) for flag in missing], self.process_group)
            missing = [flag > 0 for flag in flags]
        tuned = False
        for (op, key), needed in zip(keys.items(), missing, strict=True):
            if needed:
                self._tune(op, key, backend=backend, batch=batch, prepared=prepared)
                tuned = True
        if tuned:
            backend.forget_launchers()

    def _tune(self, op: str, key: KnobKey, *, backend: Any, batch: ExpertBatch, prepared) -> None:
        """Times the candidates of one op (lockstep and MAX-reduced under a group) and stores the
        winner. A rank with an empty batch has nothing to time: it reports 0 s for every
        candidate (the others decide) and stores nothing."""
        timed = batch.capacity > 0
        if self.process_group is None and not timed:
            return
        candidates = backend.knob_candidates(op, batch, prepared)

        def seconds_of(knobs) -> float:
            if not timed:
                return 0.0
            run = backend.expert_runner(batch, prepared, knobs={op: knobs})  # may fail: it loses
            trial = KnobTrial(op=op, knobs=knobs, key=key, run=run, device=batch.rows_MH.device)
            return self.seconds_of(trial)

        best, seconds = pick_fastest(candidates, seconds_of, process_group=self.process_group)
        if timed:
            store_tuned(backend.knob_cache, key, best, seconds=min(seconds))


def _refuse_under_capture(batch: ExpertBatch) -> None:
    device = batch.rows_MH.device
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "knobs='auto' times candidate kernels the first time a batch class arrives, which "
            "cannot happen inside a CUDA graph capture: run one forward of the same shapes "
            "before capturing"
        )
