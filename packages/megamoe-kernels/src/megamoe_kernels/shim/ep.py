"""Stable API of the expert-parallel communication kernels: compile cache and launchers.

Every kernel (drop/ep_sync.py, ep_place.py, ep_dispatch.py, ep_dispatch_small.py, ep_combine.py)
takes its per-call arguments (device addresses and counts), then the dispatcher's `EpParams`
(the peer table, epoch, status, group and static sizes: built once per workspace binding), then
its compile-time constants. So a launch converts no tensors: each compiled function is cached by
its constants (top_k, grid, unroll) and called with ints on PyTorch's current stream, which
CUDA-graph capture records. The symmetric buffers and their peer table come from the caller (the
runtime's workspace); see drop/ep_sync.py for the buffer, signal and status layouts.

Each launcher is declared once: `@_ep_kernel` names its drop kernel and how its compile-time
constants derive from the EpParams, its keyword-only parameters are the per-call arguments in the
drop's order, and its body checks them. The compiled signature's integer types come from the
drop's annotations, and the audit table's entries (`audit_entries`) from the same declarations.

`compile_all` compiles every kernel without a GPU (CUTE_DSL_ARCH=sm_90a), for CI.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import threading
from collections.abc import Callable

import torch

_COMPILED: dict[tuple, object] = {}
# the EpParams fields the drop's EpParams declares Constexpr
COMPILE_TIME_FIELDS = ("top_k", "grid", "fp8_rows", "fp8_combine")
_COMPILE_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class EpParams:
    """What every expert-parallel kernel of one dispatcher takes alike, built once per workspace
    binding: the host-side twin of the drop's ep_sync.EpParams (same fields; the audit checks).

    Addresses: `peer_table_address` (int64 [buffers, world], layout()), `epoch_address` (int64
    [1]), `status_address` (int64 [status words], host-mapped), `placement_scratch_address`
    (int32 [placement_scratch_words], zeroed once) and `small_scratch_address` (int32
    [small_dispatch_limits()["scratch_words"]], zeroed once; 0 when the small dispatch is not
    used). Sizes: this `rank` of `world`, `num_experts` in all and `local_experts` per rank,
    `capacity` batch rows, at most `max_tokens` tokens per rank and call of `row_vectors` 16-byte
    vectors each (of the bf16 token row), `top_k` experts per token; `pair_weights`: the
    partial-sum combine follows (the dispatch fills its pair tables); `timeout_ns` per wait;
    `grid` CTAs per persistent kernel, the same on every rank. The FP8 wire: `fp8_rows` (the
    dispatch quantizes the token rows: the batch and staged rows are e4m3 with their scales) and
    `fp8_combine` (the combine quantizes the rows or partial sums it sends back); both need a
    row of a multiple of 16 values (an even row_vectors).

    Compile time: top_k, grid, fp8_rows and fp8_combine (`compile_time`); every other field is
    passed at each launch.
    """

    peer_table_address: int
    epoch_address: int
    status_address: int
    placement_scratch_address: int
    small_scratch_address: int
    timeout_ns: int
    rank: int
    world: int
    num_experts: int
    local_experts: int
    capacity: int
    max_tokens: int
    row_vectors: int
    pair_weights: bool
    top_k: int
    grid: int
    fp8_rows: bool = False
    fp8_combine: bool = False

    def __post_init__(self) -> None:
        positive = ("world", "local_experts", "capacity", "max_tokens", "row_vectors", "top_k")
        for name in (*positive, "grid"):
            if getattr(self, name) < 1:
                raise ValueError(f"EpParams.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"EpParams.rank must be in [0, world={self.world}), got {self.rank}")
        if self.num_experts != self.local_experts * self.world:
            raise ValueError(
                f"EpParams.num_experts must be local_experts x world = "
                f"{self.local_experts} x {self.world}, got {self.num_experts}"
            )
        for name in ("fp8_rows", "fp8_combine"):
            if getattr(self, name) and self.row_vectors % 2:
                raise ValueError(
                    f"EpParams.{name} needs rows of a multiple of 16 values (whole 16-byte e4m3 "
                    f"vectors: an even row_vectors), got row_vectors={self.row_vectors}"
                )

    @property
    def compile_time(self) -> dict[str, int]:
        """The fields the kernels are compiled for (the rest are passed at each launch)."""
        return {name: int(getattr(self, name)) for name in COMPILE_TIME_FIELDS}

    @property
    def dispatch_row_bytes(self) -> int:
        """Bytes of a row as the dispatch moves it: e4m3 with fp8_rows, else bf16."""
        return self.row_bytes // 2 if self.fp8_rows else self.row_bytes

    @property
    def row_bytes(self) -> int:
        return self.row_vectors * 16

    @functools.cached_property
    def drop_params(self):
        """The drop's ep_sync.EpParams of these values (imports CuTe DSL)."""
        from megamoe_kernels.drop import ep_sync

        values = {field.name: int(getattr(self, field.name)) for field in dataclasses.fields(self)}
        return ep_sync.EpParams(**values)


@dataclasses.dataclass(frozen=True)
class EpKernel:
    """A drop kernel as the shim launches it: `function` of drop module `module`, called with
    `arguments` (per call), the EpParams, then `constants` (compile time, each derived from the
    EpParams), then the stream."""

    module: str
    function: str
    arguments: tuple[str, ...]
    constants: dict[str, Callable[[EpParams], int]]

    @property
    def drop_parameters(self) -> tuple[str, ...]:
        return (*self.arguments, "params", *self.constants, "stream")


KERNELS: dict[str, EpKernel] = {}


def _ep_kernel(module: str, **constants: Callable[[EpParams], int]):
    """Declares the decorated function as the launcher of drop kernel `module.<its name>`; see
    the module docstring. The function's body checks the arguments before anything compiles."""

    def declare(check: Callable[..., None]) -> Callable[..., None]:
        parameters = inspect.signature(check).parameters.values()
        arguments = tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)
        kernel = EpKernel(module, check.__name__, arguments, constants)
        KERNELS[kernel.function] = kernel

        @functools.wraps(check)
        def launch(params: EpParams, **call: int) -> None:
            check(params, **call)
            launcher = _compiled(kernel, params.compile_time, _constants(kernel, params))
            launcher([call[name] for name in kernel.arguments], params.drop_params, _stream())

        return launch

    return declare


def _constants(kernel: EpKernel, params: EpParams) -> tuple[int, ...]:
    return tuple(derive(params) for derive in kernel.constants.values())


def audit_entries() -> list[tuple[str, str, tuple[str, ...]]]:
    """(drop module, function, parameters passed by position) of every kernel launched here."""
    return [(k.module, k.function, k.drop_parameters) for k in KERNELS.values()]


def params_fields() -> tuple[str, ...]:
    """The fields of EpParams, which the drop's ep_sync.EpParams must take by keyword."""
    return tuple(field.name for field in dataclasses.fields(EpParams))


def _drop_constants():
    from megamoe_kernels.drop import ep_sync

    return ep_sync


def phases() -> dict[str, int]:
    """Phase numbers the kernels record in a timeout status, by name."""
    sync = _drop_constants()
    return {
        "dispatch counts": sync.PHASE_COUNTS,
        "dispatch rows": sync.PHASE_ROWS,
        "combine": sync.PHASE_RETURNED,
    }


def layout() -> dict[str, int]:
    """Peer-table rows and block sizes the runtime allocates for."""
    sync = _drop_constants()
    return {
        "counts": sync.BUFFER_COUNTS,
        "signals": sync.BUFFER_SIGNALS,
        "rows": sync.BUFFER_ROWS,
        "row_sources": sync.BUFFER_ROW_SOURCES,
        "returned": sync.BUFFER_RETURNED,
        "staged": sync.BUFFER_STAGED,
        "pair_rows": sync.BUFFER_PAIR_ROWS,
        "pair_weights": sync.BUFFER_PAIR_WEIGHTS,
        "partials": sync.BUFFER_PARTIALS,
        "arrived": sync.BUFFER_ARRIVED,
        "ids": sync.BUFFER_IDS,
        "row_scales": sync.BUFFER_ROW_SCALES,
        "staged_scales": sync.BUFFER_STAGED_SCALES,
        "returned_scales": sync.BUFFER_RETURNED_SCALES,
        "partial_scales": sync.BUFFER_PARTIAL_SCALES,
        "num_buffers": sync.NUM_BUFFERS,
        "num_phases": sync.NUM_PHASES,
        "status_words": sync.STATUS_WORDS,
    }


def _compiled(
    kernel: EpKernel, compile_time: dict[str, int], constants: tuple, *, fake: bool = False
):
    key = (kernel.function, tuple(compile_time.items()), constants, fake)
    compiled = _COMPILED.get(key)
    if compiled is not None:
        return compiled
    with _COMPILE_LOCK:
        compiled = _COMPILED.get(key)
        if compiled is None:
            if not torch.cuda.is_available():
                os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
            import cutlass.cute as cute
            from cutlass.cute.runtime import make_fake_stream

            drop = importlib.import_module(f"megamoe_kernels.drop.{kernel.module}")
            function = getattr(drop, kernel.function)
            annotations = inspect.signature(function).parameters
            types = [annotations[name].annotation for name in kernel.arguments]
            sample = _sample_params(**compile_time).drop_params
            stream = make_fake_stream() if fake else _stream()
            samples = [kind(0) for kind in types]
            compiled = _Launcher(
                cute.compile(function, *samples, sample, *constants, stream), types
            )
            _COMPILED[key] = compiled
    return compiled


def _sample_params(*, top_k: int, grid: int, fp8_rows: int = 0, fp8_combine: int = 0) -> EpParams:
    """EpParams to compile with: the compile-time fields as given, the rest any valid value."""
    return EpParams(
        peer_table_address=0,
        epoch_address=0,
        status_address=0,
        placement_scratch_address=0,
        small_scratch_address=0,
        timeout_ns=0,
        rank=0,
        world=1,
        num_experts=1,
        local_experts=1,
        capacity=1,
        max_tokens=1,
        row_vectors=2,
        pair_weights=False,
        top_k=top_k,
        grid=grid,
        fp8_rows=bool(fp8_rows),
        fp8_combine=bool(fp8_combine),
    )


class _Launcher:
    """A compiled kernel called with ints: wraps each per-call value in the cutlass integer type
    the drop declares for it."""

    def __init__(self, compiled, types):
        self.compiled = compiled
        self.types = types

    def __call__(self, values, params, stream):
        arguments = (kind(value) for kind, value in zip(self.types, values, strict=True))
        self.compiled(*arguments, params, stream)


def copy_unroll(row_bytes: int) -> int:
    """Loads each lane keeps in flight when a warp copies a row: the largest of 8, 4, 2 whose
    32 x unroll x 16 bytes divide the row, else 1 (which copies any row)."""
    if row_bytes % 16:
        raise ValueError(f"row bytes must be a multiple of 16, got {row_bytes}")
    vectors = row_bytes // 16
    return next((u for u in (8, 4, 2) if vectors % (32 * u) == 0), 1)


def combine_unroll(hidden: int) -> int:
    """16-byte vectors per lane and row the partial-sum kernels keep in flight (times top_k on
    the owner side): 2 where 64 vectors divide the row, else 1."""
    return 2 if (hidden // 8) % 64 == 0 else 1


def _stream():
    import cuda.bindings.driver as cuda_driver

    return cuda_driver.CUstream(torch.cuda.current_stream().cuda_stream)


def compile_all(
    *,
    top_k: int,
    grid: int,
    row_bytes: int = 7168 * 2,
    fp8_rows: bool = False,
    fp8_combine: bool = False,
) -> int:
    """Compiles every kernel for (top_k, grid, bf16 row_bytes, the FP8 wire flags) without
    launching; returns how many are cached."""
    params = dataclasses.replace(
        _sample_params(top_k=top_k, grid=grid, fp8_rows=fp8_rows, fp8_combine=fp8_combine),
        row_vectors=row_bytes // 16,
    )
    for kernel in KERNELS.values():
        _compiled(kernel, params.compile_time, _constants(kernel, params), fake=True)
    return len(_COMPILED)


def cached_kernel_count() -> int:
    return len(_COMPILED)


def placement_scratch_words(num_experts: int, world: int) -> int:
    """int32 words of the scratch exchange_and_place needs (zero it once when allocating: its
    grid-barrier words start at 0 and return there)."""
    from megamoe_kernels.drop import ep_place

    if num_experts > ep_place.PLACE_MAX_EXPERTS:
        raise ValueError(
            f"the expert-parallel placement supports up to {ep_place.PLACE_MAX_EXPERTS} experts, "
            f"got num_experts={num_experts}"
        )
    return ep_place.scratch_words(num_experts, world)


def small_dispatch_limits() -> dict[str, int]:
    """What dispatch_small takes: at most `max_pairs` pairs over every source (world x
    max_tokens x top_k), `max_local_experts` experts per rank; its scratch words (zeroed once)."""
    from megamoe_kernels.drop import ep_dispatch_small

    return {
        "max_pairs": ep_dispatch_small.SMALL_MAX_PAIRS,
        "max_local_experts": ep_dispatch_small.SMALL_MAX_LOCAL_EXPERTS,
        "scratch_words": ep_dispatch_small.SMALL_SCRATCH_WORDS,
    }


def ids_shape(world: int, max_tokens: int, top_k: int) -> tuple[int, int]:
    """(rows, int32 words per row) of the small dispatch's symmetric ids buffer."""
    from megamoe_kernels.drop import ep_dispatch_small

    return ep_dispatch_small.ids_rows(world), ep_dispatch_small.ids_words(max_tokens, top_k)


def _copy_unroll(params: EpParams) -> int:
    return copy_unroll(params.row_bytes)


def _dispatch_unroll(params: EpParams) -> int:
    return copy_unroll(params.dispatch_row_bytes)


def _combine_unroll(params: EpParams) -> int:
    return combine_unroll(params.row_vectors * 8)


# ---------------------------------------------------------------------------------------------
# The launchers: one per drop kernel, in the order a dispatch and a combine run them


@_ep_kernel("ep_place")
def exchange_and_place(
    params: EpParams,
    *,
    expert_of_pair_address: int,
    dest_row_address: int,
    expert_offsets_address: int,
    num_pairs: int,
) -> None:
    """Bumps the epoch, counts pairs per expert, all-gathers the counts (int32 [world, E] on
    every peer), waits, and writes each pair's row in its owner's batch (dest_row, int32 [P])
    and this rank's expert_offsets (int32 [local_experts + 1]); each source's pair count goes
    to the placement scratch, for dispatch_tokens."""
    if num_pairs < 0:
        raise ValueError(f"num_pairs must be >= 0, got {num_pairs}")


@_ep_kernel("ep_dispatch", unroll=_dispatch_unroll)
def dispatch_rows(
    params: EpParams,
    *,
    x_address: int,
    expert_of_pair_address: int,
    dest_row_address: int,
    weights_address: int,
    num_pairs: int,
) -> None:
    """The direct dispatch: sends every pair's token row straight into its owner's batch row
    with the pair's (rank, pair); signals each peer (wait_phase waits for them)."""
    if num_pairs < 0:
        raise ValueError(f"num_pairs must be >= 0, got {num_pairs}")


@_ep_kernel("ep_dispatch", unroll=_dispatch_unroll)
def dispatch_tokens(
    params: EpParams,
    *,
    x_address: int,
    expert_of_pair_address: int,
    dest_row_address: int,
    weights_address: int,
    tokens: int,
) -> None:
    """The staged dispatch after exchange_and_place, in one kernel: each token row is read once
    and written into this rank's batch rows and once into each other owner's staged rows (with
    its table entries and a per-token flag); then each owner copies every arrived staged row into
    its batch rows as its flag lands. Returns (on the stream) with this rank's batch complete."""
    if params.world > 32:
        raise ValueError(f"dispatch_tokens supports up to 32 ranks, got {params.world}")
    _check_tokens(tokens, params)


@_ep_kernel("ep_dispatch_small", unroll=_dispatch_unroll)
def dispatch_small(
    params: EpParams,
    *,
    x_address: int,
    expert_of_pair_address: int,
    weights_address: int,
    expert_offsets_address: int,
    tokens: int,
) -> None:
    """The whole staged dispatch of a small batch in one kernel (instead of exchange_and_place
    and dispatch_tokens): each rank sends its expert ids and its token rows at once, and each
    owner places its own rows from every source's ids. Writes this rank's batch, its
    expert_offsets, the pair table and the rows' (source, pair) as the two-kernel dispatch does
    (no dest_row). Returns (on the stream) with this rank's batch complete."""
    problems = small_dispatch_problems(
        world=params.world,
        max_tokens=params.max_tokens,
        top_k=params.top_k,
        local_experts=params.local_experts,
        grid=params.grid,
    )
    if problems:
        raise ValueError(f"dispatch_small cannot take this group: {'; '.join(problems)}")
    _check_tokens(tokens, params)


def small_dispatch_problems(
    *, world: int, max_tokens: int, top_k: int, local_experts: int, grid: int
) -> list[str]:
    """Why dispatch_small cannot serve these sizes (empty when it can): its shared memory holds
    every source's ids and a counter per (warp, local expert), and a source's ids row holds
    max_tokens x top_k; beyond these the kernel would write past them."""
    from megamoe_kernels.drop import ep_dispatch_small as small

    problems = []
    pairs = world * max_tokens * top_k
    if world > small.SMALL_MAX_RANKS:
        problems.append(f"it supports up to {small.SMALL_MAX_RANKS} ranks, got {world}")
    if pairs > small.SMALL_MAX_PAIRS:
        problems.append(
            f"it takes world x max_tokens x top_k <= {small.SMALL_MAX_PAIRS} pairs, got "
            f"{world} x {max_tokens} x {top_k} = {pairs}"
        )
    if local_experts > small.SMALL_MAX_LOCAL_EXPERTS:
        problems.append(
            f"it supports up to {small.SMALL_MAX_LOCAL_EXPERTS} experts per rank, got "
            f"local_experts={local_experts}"
        )
    if grid < 2:
        problems.append(f"it needs a grid of at least 2 CTAs, got {grid}")
    return problems


def _check_tokens(tokens: int, params: EpParams) -> None:
    if not 0 <= tokens <= params.max_tokens:
        raise ValueError(f"tokens must be in [0, max_tokens={params.max_tokens}], got {tokens}")


@_ep_kernel("ep_sync")
def wait_phase(params: EpParams, *, phase: int) -> None:
    """Waits (one CTA) until every source's adds of this epoch in `phase` arrived (one per CTA
    of a grid of params.grid)."""
    if phase not in phases().values():
        raise ValueError(f"phase must be one of {phases()}, got {phase}")


@_ep_kernel("ep_combine", unroll=_copy_unroll)
def combine_push(params: EpParams, *, expert_out_address: int, expert_offsets_address: int) -> None:
    """Sends each valid batch row's output to its source's returned buffer; signals each peer."""


@_ep_kernel("ep_combine")
def combine_reduce(params: EpParams, *, weights_address: int, y_address: int, tokens: int) -> None:
    """Waits for every owner's outputs, then y[t] = sum_k w[t, k] x returned[t, k] in k order."""
    _check_tokens(tokens, params)


@_ep_kernel("ep_combine", unroll=_combine_unroll)
def combine_partial(
    params: EpParams, *, expert_out_address: int, expert_offsets_address: int
) -> None:
    """On the owner: one weighted partial sum per (token, source) into the source's partials."""


@_ep_kernel("ep_combine", unroll=_combine_unroll)
def combine_partial_sum(
    params: EpParams, *, expert_of_pair_address: int, y_address: int, tokens: int
) -> None:
    """On the source: waits for every owner, then sums each token's partials in rank order."""
    _check_tokens(tokens, params)
