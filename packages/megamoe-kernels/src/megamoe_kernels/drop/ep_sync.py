"""Cross-GPU signalling for the expert-parallel kernels: release adds, acquire spins, timeouts.

Every signal is a monotonically increasing int64 counter in symmetric memory, one per
(phase, source rank) on each receiver: every writing thread fences at system scope, the CTA
meets at a barrier, then one thread per peer adds 1 with a system-scope release; a receiver spins
with system-scope acquire loads until the counter reaches what this epoch expects, and the
threads that read the data fence again after the barrier that follows the spin. Counters are
never reset, so buffers are reusable on the next call without any host-side work. The staged
dispatch also has one int64 flag per (source, token) on each receiver, which the source's warp
sets (release, system scope, after a fence by every lane) to 2 x epoch + (token has rows there);
the receiver's warp spins on it with acquire loads (wait_flag).

A spin gives up after `timeout_ns` (global timer) and records (phase + 1, peer, epoch, observed)
in a 4 x int64 status block (host-mapped pinned memory) that the host reads; the kernel then
carries on, so a lost peer turns into an error message instead of a hung job.

Signal block layout (int64 [NUM_PHASES, world]): slot [phase, source].
Peer tables: int64 [buffers, world] of addresses, row b = buffer b as each peer maps it.

Every kernel takes an EpParams (what stays the same from call to call: the peer table, the epoch,
the status block, the group and the static sizes) after its per-call arguments.
"""

import dataclasses
import functools

import cutlass
import cutlass.cute as cute

PHASE_COUNTS = 0  # a source's per-expert counts arrived
PHASE_ROWS = 1  # a source's dispatched rows arrived (one add per source CTA)
PHASE_RETURNED = 2  # an expert owner's outputs came home (one add per owner CTA)
NUM_PHASES = 3
STATUS_WORDS = 4

# rows of the peer table: the symmetric buffers every expert-parallel kernel may address
BUFFER_COUNTS = 0  # int32 [world, experts]: counts [source, expert] of this epoch
BUFFER_SIGNALS = 1  # int64 [NUM_PHASES, world]
BUFFER_ROWS = 2  # [capacity, hidden]: the receiver's expert-major batch
BUFFER_ROW_SOURCES = 3  # int32 [capacity, 2]: (source rank, source pair) of each batch row
BUFFER_RETURNED = 4  # [max_tokens x top_k, hidden]: expert outputs back at the source, by pair
BUFFER_STAGED = 5  # [world x max_tokens, hidden]: token rows from each source, once per owner
# the partial-sum combine: per (source, token, k) the owner's batch row (or -1) and the weight;
# per (owner, token) the owner's weighted sum, back at the source
BUFFER_PAIR_ROWS = 6  # int32 [world, max_tokens, top_k]
BUFFER_PAIR_WEIGHTS = 7  # float32 [world, max_tokens, top_k]
BUFFER_PARTIALS = 8  # [world x max_tokens, hidden]
# the staged dispatch: per (source, token) a flag the source sets to 2 x epoch + (1 if the token
# has rows on this owner) once its staged row and table entries are here
BUFFER_ARRIVED = 9  # int64 [world, max_tokens]
# the small-batch dispatch: per source its pair count, then its expert ids (pair order)
BUFFER_IDS = 10  # int32 [2 x world, 4 + max_tokens x top_k] (ep_dispatch_small)
# the FP8 wire (row_vectors.py): with fp8_rows the batch rows and the staged rows are e4m3 with
# these scales, with fp8_combine the returned rows and the partials are
BUFFER_ROW_SCALES = 11  # float32 [groups, capacity]: the batch's, group-major (the GEMM's layout)
BUFFER_STAGED_SCALES = 12  # float32 [world x max_tokens, groups]
BUFFER_RETURNED_SCALES = 13  # float32 [max_tokens x top_k, groups]
BUFFER_PARTIAL_SCALES = 14  # float32 [world x max_tokens, groups]
NUM_BUFFERS = 15


@dataclasses.dataclass(frozen=True)
class EpParams:
    """The arguments every expert-parallel kernel of one dispatcher takes alike, built once
    (a CuTe DSL JIT argument: its runtime fields are passed by value, in field order; the
    Constexpr fields are compile-time constants).

    peer_table_address: int64 [NUM_BUFFERS, world], row b = buffer b as each peer maps it
    epoch_address: int64 [1], this rank's epoch (bumped by the dispatch)
    status_address: int64 [STATUS_WORDS], host-mapped: where a timeout is recorded
    placement_scratch_address: int32 scratch of exchange_and_place (ep_place.scratch_words),
        zeroed once; dispatch_tokens reads its per-source pair counts
    small_scratch_address: int32 [SMALL_SCRATCH_WORDS] of dispatch_small, zeroed once
    timeout_ns: how long a wait spins before it records a timeout
    rank, world: this rank and the ranks of the group
    num_experts, local_experts: experts in all and per rank (expert e on rank e // local_experts)
    capacity: rows of each rank's batch (rows at or past it are dropped)
    max_tokens: tokens per rank and call, at most (the staged and returned buffers' rows)
    row_vectors: 16-byte vectors of a token row (bf16: hidden / 8)
    pair_weights: 1 when the partial-sum combine follows: the dispatch writes each pair's
        routing weight (and dispatch_rows its batch row) into its owner's pair tables
    top_k: experts per token
    grid: CTAs of the persistent kernels, the same on every rank: a receiver waits for `grid`
        adds per source and phase
    fp8_rows: 1 when the dispatch quantizes the token rows (row_vectors.py): the staged and
        batch rows are e4m3 (hidden bytes) with their scales, row_vectors still counting the
        bf16 token row's vectors
    fp8_combine: 1 when the combine quantizes what crosses NVLink back: the returned rows (or
        the partial sums) are e4m3 with their scales, summed in fp32 where they land
    """

    peer_table_address: cutlass.Int64
    epoch_address: cutlass.Int64
    status_address: cutlass.Int64
    placement_scratch_address: cutlass.Int64
    small_scratch_address: cutlass.Int64
    timeout_ns: cutlass.Int64
    rank: cutlass.Int32
    world: cutlass.Int32
    num_experts: cutlass.Int32
    local_experts: cutlass.Int32
    capacity: cutlass.Int32
    max_tokens: cutlass.Int32
    row_vectors: cutlass.Int32
    pair_weights: cutlass.Int32
    top_k: cutlass.Constexpr
    grid: cutlass.Constexpr
    fp8_rows: cutlass.Constexpr
    fp8_combine: cutlass.Constexpr

    def _runtime_fields(self):
        return [f for f in dataclasses.fields(self) if f.type is not cutlass.Constexpr]

    def _runtime_values(self):
        """Each runtime field as its DSL integer (host ints wrapped, traced values as they are)."""
        values = []
        for field in self._runtime_fields():
            value = getattr(self, field.name)
            values.append(field.type(value) if isinstance(value, int) else value)
        return values

    @functools.cached_property
    def _host_pointers(self):
        return [pointer for value in self._runtime_values() for pointer in value.__c_pointers__()]

    def __c_pointers__(self):
        # a host-side EpParams never changes: its values are converted once, not per launch
        return self._host_pointers

    def __get_mlir_types__(self):
        return [field.type.mlir_type for field in self._runtime_fields()]

    def __extract_mlir_values__(self):
        return cutlass.extract_mlir_values(self._runtime_values())

    def __new_from_mlir_values__(self, values):
        fields = self._runtime_fields()
        traced = {
            field.name: field.type(value) for field, value in zip(fields, values, strict=True)
        }
        return dataclasses.replace(self, **traced)


def global_ptr(dtype, address, align):
    return cute.make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def peer_address(peer_table, buffer, world, peer):
    """Address of `buffer` on `peer`, read from the int64 peer table."""
    return cute.arch.load(peer_table + (buffer * world + peer), cutlass.Int64)


def own_address(params, buffer):
    """This rank's address of symmetric `buffer`, from the peer table of `params` (EpParams)."""
    peer_table = global_ptr(cutlass.Int64, params.peer_table_address, 8)
    return peer_address(peer_table, buffer, params.world, params.rank)


@cute.jit
def signal_peer(peer_table, signals_buffer, world, peer, phase, source):
    """Adds 1 to signal [phase, source] on `peer`, releasing this thread's (and, after a CTA
    barrier, its CTA's) earlier writes at system scope."""
    cute.arch.fence_acq_rel_sys()
    signals = global_ptr(cutlass.Int64, peer_address(peer_table, signals_buffer, world, peer), 8)
    cute.arch.red(
        signals + (phase * world + source),
        cutlass.Int64(1),
        op="add",
        dtype="u64",
        sem="release",
        scope="sys",
    )


@cute.jit
def thread_position():
    """(thread, block, grid size, warp, lane) of the calling thread in a 1-D launch."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    return tidx, bidx, grid, tidx // 32, tidx % 32


@cute.jit
def count_on_peer(peer_table, signals_buffer, world, peer, phase, source, amount):
    """Adds `amount` to signal [phase, source] on `peer`, relaxed: it releases nothing, for a
    counter kept in step that no reader takes as a sign that data arrived."""
    signals = global_ptr(cutlass.Int64, peer_address(peer_table, signals_buffer, world, peer), 8)
    cute.arch.red(
        signals + (phase * world + source),
        cutlass.Int64(amount),
        op="add",
        dtype="u64",
        sem="relaxed",
        scope="sys",
    )


@cute.jit
def wait_signal(signals_address, status_address, world, phase, peer, target, epoch, timeout_ns):
    """Spins until local signal [phase, peer] >= target; on timeout records the status."""
    signals = global_ptr(cutlass.Int64, signals_address, 8)
    wait_flag(
        signals + (phase * world + peer), status_address, phase, peer, target, epoch, timeout_ns
    )


@cute.jit
def wait_flag(flag, status_address, phase, peer, target, epoch, timeout_ns):
    """Spins until the int64 at `flag` (a local pointer) is >= target, with system-scope acquire
    loads; returns the value seen, or records the status on timeout (and returns what it saw)."""
    start = cute.arch.globaltimer()
    waiting = cutlass.Int32(1)
    seen = cutlass.Int64(0)
    while waiting == 1:
        seen = cute.arch.load(flag, cutlass.Int64, sem="acquire", scope="sys")
        if seen >= target:
            waiting = cutlass.Int32(0)
        elif cute.arch.globaltimer() - start > timeout_ns:
            record_timeout(status_address, phase, peer, epoch, seen)
            waiting = cutlass.Int32(0)
    return seen


@cute.jit
def record_timeout(status_address, phase, peer, epoch, seen):
    """Records (phase + 1, peer, epoch, observed) in the status block unless an earlier
    timeout of the same call did: the first one is the cause."""
    status = global_ptr(cutlass.Int64, status_address, 8)
    if cute.arch.load(status, cutlass.Int64, sem="acquire", scope="sys") == 0:
        cute.arch.store(status + 1, cutlass.Int64(peer))
        cute.arch.store(status + 2, epoch)
        cute.arch.store(status + 3, seen)
        cute.arch.store(status, cutlass.Int64(phase + 1), sem="release", scope="sys")


@cute.jit
def wait_for_every_source(
    signals_address, status_address, world, phase, epoch, adds_per_epoch, timeout_ns
):
    """Called by a whole CTA: thread s < world waits for source s's adds of this epoch in
    `phase` (epoch x adds_per_epoch in all); then a CTA barrier and a system-scope fence, so
    every thread of the CTA sees what the sources wrote before they signalled."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx < world:
        target = epoch * cutlass.Int64(adds_per_epoch)
        wait_signal(signals_address, status_address, world, phase, tidx, target, epoch, timeout_ns)
    cute.arch.sync_threads()
    cute.arch.fence_acq_rel_sys()


@cute.kernel
def wait_phase_kernel(phase: cutlass.Int32, params: EpParams):
    """One CTA: thread s waits for source s's adds of this epoch in `phase` (one per CTA of the
    source's kernel: params.grid)."""
    epoch = cute.arch.load(global_ptr(cutlass.Int64, params.epoch_address, 8), cutlass.Int64)
    wait_for_every_source(
        own_address(params, BUFFER_SIGNALS),
        params.status_address,
        params.world,
        phase,
        epoch,
        params.grid,
        params.timeout_ns,
    )


@cute.jit
def wait_phase(phase: cutlass.Int32, params: EpParams, stream):
    wait_phase_kernel(phase, params).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)
