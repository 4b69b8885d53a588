"""Stable API of the expert-parallel communication kernels: compile cache and launchers.

The kernels (drop/ep_sync.py, ep_place.py, ep_dispatch.py, ep_combine.py) take device addresses
and scalars only, so a launch converts no tensors: each compiled function is cached by its
compile-time constants (top_k, grid) and called with ints on PyTorch's current stream, which
CUDA-graph capture records. The symmetric buffers and their peer table come from the caller (the runtime's
workspace); see drop/ep_sync.py for the buffer, signal and status layouts.

`compile_all` compiles every kernel without a GPU (CUTE_DSL_ARCH=sm_90a), for CI.
"""

from __future__ import annotations

import os
import threading

import torch

_COMPILED: dict[tuple, object] = {}
_COMPILE_LOCK = threading.Lock()

# kernel name -> (drop module, function, signature of runtime arguments: "i64" | "i32")
_KERNELS = {
    "wait_phase": ("ep_sync", "wait_phase", ("i64",) * 3 + ("i32",) * 3 + ("i64",)),
    "exchange_and_place": (
        "ep_place",
        "exchange_and_place",
        ("i64",) * 7 + ("i32",) * 6 + ("i64",),
    ),
    "dispatch_rows": (
        "ep_dispatch",
        "dispatch_rows",
        ("i64",) * 4 + ("i32",) * 8 + ("i64", "i32"),
    ),
    "dispatch_tokens": (
        "ep_dispatch",
        "dispatch_tokens",
        ("i64",) * 8 + ("i32",) * 8 + ("i64",),
    ),
    "dispatch_small": (
        "ep_dispatch_small",
        "dispatch_small",
        ("i64",) * 8 + ("i32",) * 8 + ("i64",),
    ),
    "combine_push": ("ep_combine", "combine_push", ("i64",) * 4 + ("i32",) * 5),
    "combine_partial": ("ep_combine", "combine_partial", ("i64",) * 6 + ("i32",) * 6),
    "combine_partial_sum": (
        "ep_combine",
        "combine_partial_sum",
        ("i64",) * 6 + ("i32",) * 6 + ("i64",),
    ),
    "combine_reduce": (
        "ep_combine",
        "combine_reduce",
        ("i64",) * 6 + ("i32",) * 4 + ("i64",),
    ),
}


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
        "num_buffers": sync.NUM_BUFFERS,
        "num_phases": sync.NUM_PHASES,
        "status_words": sync.STATUS_WORDS,
    }


def _compiled(name: str, constants: tuple = (), *, fake: bool = False):
    key = (name, constants, fake)
    compiled = _COMPILED.get(key)
    if compiled is not None:
        return compiled
    with _COMPILE_LOCK:
        compiled = _COMPILED.get(key)
        if compiled is None:
            if not torch.cuda.is_available():
                os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
            import importlib

            import cutlass
            import cutlass.cute as cute
            from cutlass.cute.runtime import make_fake_stream

            module, function, signature = _KERNELS[name]
            kernel = getattr(importlib.import_module(f"megamoe_kernels.drop.{module}"), function)
            samples = [
                cutlass.Int64(0) if kind == "i64" else cutlass.Int32(0) for kind in signature
            ]
            stream = make_fake_stream() if fake else _stream()
            compiled = _Launcher(
                cute.compile(kernel, *samples, *constants, stream),
                [cutlass.Int64 if kind == "i64" else cutlass.Int32 for kind in signature],
            )
            _COMPILED[key] = compiled
    return compiled


class _Launcher:
    """A compiled kernel called with ints: wraps each in its declared cutlass integer type."""

    def __init__(self, compiled, types):
        self.compiled = compiled
        self.types = types

    def __call__(self, *args):
        *scalars, stream = args
        self.compiled(
            *(kind(value) for kind, value in zip(self.types, scalars, strict=True)), stream
        )


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


def compile_all(*, top_k: int, grid: int, row_bytes: int = 7168 * 2) -> int:
    """Compiles every kernel for (top_k, grid, row_bytes) without launching; returns how many
    are cached."""
    unroll = copy_unroll(row_bytes)
    _compiled("wait_phase", fake=True)
    _compiled("exchange_and_place", fake=True)
    _compiled("dispatch_rows", (grid, unroll), fake=True)
    _compiled("dispatch_tokens", (top_k, grid, unroll), fake=True)
    _compiled("dispatch_small", (top_k, grid, unroll), fake=True)
    _compiled("combine_push", (grid, unroll), fake=True)
    _compiled("combine_reduce", (top_k, grid), fake=True)
    partial_unroll = combine_unroll(row_bytes // 2)
    _compiled("combine_partial", (top_k, grid, partial_unroll), fake=True)
    _compiled("combine_partial_sum", (top_k, grid, partial_unroll), fake=True)
    return len(_COMPILED)


def placement_scratch_words(num_experts: int, world: int) -> int:
    """int32 words of the scratch exchange_and_place needs (zero it once when allocating: its
    grid-barrier words start at 0 and return there); its per-source pair counts, which
    dispatch_tokens reads, start at `pairs_of_source_offset`."""
    from megamoe_kernels.drop import ep_place

    if num_experts > ep_place.PLACE_MAX_EXPERTS:
        raise ValueError(
            f"the expert-parallel placement supports up to {ep_place.PLACE_MAX_EXPERTS} experts, "
            f"got num_experts={num_experts}"
        )
    return ep_place.scratch_words(num_experts, world)


def pairs_of_source_offset(num_experts: int) -> int:
    """int32 word of the placement scratch where the per-source pair counts start."""
    from megamoe_kernels.drop import ep_place

    return ep_place.pairs_of_source_offset(num_experts)


def exchange_and_place(
    expert_of_pair_address: int,
    dest_row_address: int,
    expert_offsets_address: int,
    scratch_address: int,
    *,
    peer_table_address: int,
    epoch_address: int,
    status_address: int,
    num_pairs: int,
    rank: int,
    world: int,
    num_experts: int,
    local_experts: int,
    capacity: int,
    timeout_ns: int,
) -> None:
    """Bumps the epoch, counts pairs per expert, all-gathers the counts (int32 [world, E] on
    every peer), waits, and writes each pair's row in its owner's batch (dest_row, int32 [P])
    and this rank's expert_offsets (int32 [local_experts + 1])."""
    _compiled("exchange_and_place")(
        expert_of_pair_address,
        dest_row_address,
        expert_offsets_address,
        scratch_address,
        peer_table_address,
        epoch_address,
        status_address,
        num_pairs,
        rank,
        world,
        num_experts,
        local_experts,
        capacity,
        timeout_ns,
        _stream(),
    )


def dispatch_rows(
    x_address: int,
    expert_of_pair_address: int,
    dest_row_address: int,
    *,
    peer_table_address: int,
    num_pairs: int,
    top_k: int,
    local_experts: int,
    row_bytes: int,
    capacity: int,
    rank: int,
    world: int,
    max_tokens: int,
    weights_address: int = 0,
    pair_tables: bool = False,
    grid: int,
) -> None:
    """The direct dispatch: sends every pair's token row straight into its owner's batch row
    with the pair's (rank, pair); signals each peer (wait_phase waits for them)."""
    _compiled("dispatch_rows", (grid, copy_unroll(row_bytes)))(
        x_address,
        expert_of_pair_address,
        dest_row_address,
        peer_table_address,
        num_pairs,
        top_k,
        local_experts,
        row_bytes // 16,
        capacity,
        rank,
        world,
        max_tokens,
        weights_address,
        int(pair_tables),
        _stream(),
    )


def dispatch_tokens(
    x_address: int,
    expert_of_pair_address: int,
    dest_row_address: int,
    weights_address: int,
    *,
    pairs_of_source_address: int,
    peer_table_address: int,
    epoch_address: int,
    status_address: int,
    tokens: int,
    top_k: int,
    local_experts: int,
    row_bytes: int,
    capacity: int,
    rank: int,
    world: int,
    max_tokens: int,
    pair_weights: bool,
    timeout_ns: int,
    grid: int,
) -> None:
    """The staged dispatch after exchange_and_place, in one kernel: each token row is read once
    and written into this rank's batch rows and once into each other owner's staged rows (with
    its table entries and a per-token flag); then each owner copies every arrived staged row into
    its batch rows as its flag lands. Returns (on the stream) with this rank's batch complete."""
    if world > 32:
        raise ValueError(f"dispatch_tokens supports up to 32 ranks, got {world}")
    _compiled("dispatch_tokens", (top_k, grid, copy_unroll(row_bytes)))(
        x_address,
        expert_of_pair_address,
        dest_row_address,
        weights_address,
        pairs_of_source_address,
        peer_table_address,
        epoch_address,
        status_address,
        tokens,
        local_experts,
        row_bytes // 16,
        capacity,
        rank,
        world,
        max_tokens,
        int(pair_weights),
        timeout_ns,
        _stream(),
    )


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


def dispatch_small(
    x_address: int,
    expert_of_pair_address: int,
    weights_address: int,
    expert_offsets_address: int,
    scratch_address: int,
    *,
    peer_table_address: int,
    epoch_address: int,
    status_address: int,
    tokens: int,
    top_k: int,
    local_experts: int,
    row_bytes: int,
    capacity: int,
    rank: int,
    world: int,
    max_tokens: int,
    pair_weights: bool,
    timeout_ns: int,
    grid: int,
) -> None:
    """The whole staged dispatch of a small batch in one kernel (instead of exchange_and_place
    and dispatch_tokens): each rank sends its expert ids and its token rows at once, and each
    owner places its own rows from every source's ids. Writes this rank's batch, its
    expert_offsets, the pair table and the rows' (source, pair) as the two-kernel dispatch does
    (no dest_row). Returns (on the stream) with this rank's batch complete."""
    from megamoe_kernels.drop import ep_dispatch_small as small

    # its shared memory holds every source's ids and a counter per (warp, local expert), and a
    # source's ids row holds max_tokens x top_k: beyond these the kernel would write past them
    pairs = world * max_tokens * top_k
    if world > small.SMALL_MAX_RANKS:
        raise ValueError(
            f"dispatch_small supports up to {small.SMALL_MAX_RANKS} ranks, got {world}"
        )
    if pairs > small.SMALL_MAX_PAIRS:
        raise ValueError(
            f"dispatch_small takes world x max_tokens x top_k <= {small.SMALL_MAX_PAIRS} pairs, "
            f"got {world} x {max_tokens} x {top_k} = {pairs}"
        )
    if local_experts > small.SMALL_MAX_LOCAL_EXPERTS:
        raise ValueError(
            f"dispatch_small supports up to {small.SMALL_MAX_LOCAL_EXPERTS} experts per rank, "
            f"got local_experts={local_experts}"
        )
    if not 0 <= tokens <= max_tokens:
        raise ValueError(f"tokens must be in [0, max_tokens={max_tokens}], got {tokens}")
    if grid < 2:
        raise ValueError(f"dispatch_small needs a grid of at least 2 CTAs, got {grid}")
    _compiled("dispatch_small", (top_k, grid, copy_unroll(row_bytes)))(
        x_address,
        expert_of_pair_address,
        weights_address,
        expert_offsets_address,
        scratch_address,
        peer_table_address,
        epoch_address,
        status_address,
        tokens,
        local_experts,
        row_bytes // 16,
        capacity,
        rank,
        world,
        max_tokens,
        int(pair_weights),
        timeout_ns,
        _stream(),
    )


def wait_phase(
    *,
    signals_address: int,
    epoch_address: int,
    status_address: int,
    world: int,
    phase: int,
    adds_per_epoch: int,
    timeout_ns: int,
) -> None:
    """Waits (one CTA) until every source's adds of this epoch in `phase` arrived."""
    _compiled("wait_phase")(
        signals_address,
        epoch_address,
        status_address,
        world,
        phase,
        adds_per_epoch,
        timeout_ns,
        _stream(),
    )


def combine_push(
    expert_out_address: int,
    expert_offsets_address: int,
    row_sources_address: int,
    *,
    peer_table_address: int,
    local_experts: int,
    row_bytes: int,
    capacity: int,
    rank: int,
    world: int,
    grid: int,
) -> None:
    """Sends each valid batch row's output to its source's returned buffer; signals each peer."""
    _compiled("combine_push", (grid, copy_unroll(row_bytes)))(
        expert_out_address,
        expert_offsets_address,
        row_sources_address,
        peer_table_address,
        local_experts,
        row_bytes // 16,
        capacity,
        rank,
        world,
        _stream(),
    )


def combine_reduce(
    returned_address: int,
    weights_address: int,
    y_address: int,
    *,
    signals_address: int,
    epoch_address: int,
    status_address: int,
    tokens: int,
    hidden: int,
    world: int,
    adds_per_epoch: int,
    timeout_ns: int,
    top_k: int,
    grid: int,
) -> None:
    """Waits for every owner's outputs, then y[t] = sum_k w[t, k] x returned[t, k] in k order."""
    if hidden % 8:
        raise ValueError(f"hidden must be a multiple of 8, got {hidden}")
    _compiled("combine_reduce", (top_k, grid))(
        returned_address,
        weights_address,
        y_address,
        signals_address,
        epoch_address,
        status_address,
        tokens,
        hidden,
        world,
        adds_per_epoch,
        timeout_ns,
        _stream(),
    )


def cached_kernel_count() -> int:
    return len(_COMPILED)


def combine_partial(
    expert_out_address: int,
    expert_offsets_address: int,
    row_sources_address: int,
    pair_rows_address: int,
    pair_weights_address: int,
    *,
    peer_table_address: int,
    local_experts: int,
    hidden: int,
    capacity: int,
    max_tokens: int,
    rank: int,
    world: int,
    top_k: int,
    grid: int,
) -> None:
    """On the owner: one weighted partial sum per (token, source) into the source's partials."""
    if hidden % 8:
        raise ValueError(f"hidden must be a multiple of 8, got {hidden}")
    _compiled("combine_partial", (top_k, grid, combine_unroll(hidden)))(
        expert_out_address,
        expert_offsets_address,
        row_sources_address,
        pair_rows_address,
        pair_weights_address,
        peer_table_address,
        local_experts,
        hidden,
        capacity,
        max_tokens,
        rank,
        world,
        _stream(),
    )


def combine_partial_sum(
    partials_address: int,
    expert_of_pair_address: int,
    y_address: int,
    *,
    signals_address: int,
    epoch_address: int,
    status_address: int,
    tokens: int,
    hidden: int,
    world: int,
    local_experts: int,
    max_tokens: int,
    adds_per_epoch: int,
    timeout_ns: int,
    top_k: int,
    grid: int,
) -> None:
    """On the source: waits for every owner, then sums each token's partials in rank order."""
    if hidden % 8:
        raise ValueError(f"hidden must be a multiple of 8, got {hidden}")
    _compiled("combine_partial_sum", (top_k, grid, combine_unroll(hidden)))(
        partials_address,
        expert_of_pair_address,
        y_address,
        signals_address,
        epoch_address,
        status_address,
        tokens,
        hidden,
        world,
        local_experts,
        max_tokens,
        adds_per_epoch,
        timeout_ns,
        _stream(),
    )
