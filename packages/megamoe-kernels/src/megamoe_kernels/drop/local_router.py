"""The router's logits for a few tokens on one GPU (sm_90a): logits[t, e] = sum_h x[t, h] x
W[e, h] (+ bias[e]), accumulated in fp32, for the steps where a GEMM library's launch and
split-K pair cost more than reading the router weight.

router_logits: a CTA per (block of `expert_block` <= ROUTER_MAX_EXPERT_BLOCK experts, block of
`token_block` <= ROUTER_MAX_TOKEN_BLOCK tokens), ROUTER_THREADS threads. Thread i holds the
16-byte vectors i, i + ROUTER_THREADS, ... of each of its experts' weight rows in registers
(bf16, as loaded), loaded before the kernel waits on the one before it (the weight is a
parameter no earlier kernel of the forward writes); then, vector by vector, it loads that
vector of each of the block's tokens (all in flight together) and adds its products with each
expert's vector to the (expert, token) fp32 sum (products of two bf16 are exact in fp32; added
in vector order, then element order): a token's vector, loaded once, serves the block's
experts, so a CTA reads expert_block weight rows and token_block token rows for
expert_block x token_block logits. Each sum is reduced over the warp by butterfly shuffles and
over the warps in warp order through shared memory: a fixed order whatever the blocks, so a
logit has the same bits on every launch and at every T. Thread j < expert_block x token_block
of the CTA writes the logit of expert j / token_block, token j % token_block, plus the bias
(fp32, after the sum), rounded to the logits' dtype. No atomics. The caller picks both blocks
from T and the router (compile-time constants: a block of 1 for one token does not compute 7
more).

Programmatic dependent launch: with `early_dependents` the kernel signals its dependents at its
top (the routing kernel, launched with PDL, is scheduled then and waits for this grid to finish
before reading the logits), else each CTA lets them be scheduled as it exits. It is itself
launched with PDL, waiting on the kernel before it (which may write x) before the first read of
x.

Layouts: x [T, H] bf16 and weight [E, H] bf16 row-major, H a multiple of 8, rows 16-byte
aligned; bias [E] float32 or bfloat16 (optional); logits [T, E] float32 or bfloat16 row-major.
`hidden_size` is a compile-time constant (the registers holding the weight rows:
expert_block x ceil(H / (8 x ROUTER_THREADS)) vectors per thread). T is dynamic, at least 1
(for none, launch nothing).
"""

import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator

from .row_vectors import CHUNK, load_chunk

ROUTER_THREADS = 128
ROUTER_WARPS = ROUTER_THREADS // 32
ROUTER_MAX_TOKEN_BLOCK = 8  # tokens a CTA takes at most: a thread holds a sum per token
# experts a CTA takes at most: a thread holds a sum per (expert, token), at most one per thread
# of the CTA for its final write
ROUTER_MAX_EXPERT_BLOCK = ROUTER_THREADS // ROUTER_MAX_TOKEN_BLOCK


@cute.jit
def warp_sum_float(value):
    """The sum over the warp's lanes by butterfly shuffles (the same order on every launch)."""
    for step in cutlass.range_constexpr(5):
        value = value + cute.arch.shuffle_sync_bfly(value, 1 << step)
    return value


@cute.jit
def add_products(sums, weight_vectors, x_rows, vector, token_block: cutlass.Constexpr):
    """sums[e x token_block + t] += x_rows[t]'s 16-byte vector `vector` . weight_vectors[e]
    (8 bf16 each), element by element: a product of two bf16 is exact in fp32 (short of
    overflow and underflow), so with or without contraction into an fma the sums have the same
    bits."""
    expert_block = len(weight_vectors)
    weights = []
    for e in cutlass.range_constexpr(expert_block):
        converted = cute.make_rmem_tensor(CHUNK, cutlass.Float32)
        converted.store(weight_vectors[e].to(cutlass.Float32))
        weights.append(converted)
    values = cute.make_rmem_tensor(CHUNK, cutlass.Float32)
    for t in cutlass.range_constexpr(token_block):
        values.store(
            load_chunk(x_rows[t] + cutlass.Int64(vector) * (CHUNK * 2)).to(cutlass.Float32)
        )
        for e in cutlass.range_constexpr(expert_block):
            total = sums[e * token_block + t]
            for j in cutlass.range_constexpr(CHUNK):
                total = total + values[j] * weights[e][j]
            sums[e * token_block + t] = total


@cute.kernel
def router_logits_kernel(
    mX: cute.Tensor,
    mWeight: cute.Tensor,
    mBias,
    mLogits: cute.Tensor,
    hidden_size: cutlass.Constexpr,
    token_block: cutlass.Constexpr,
    expert_block: cutlass.Constexpr,
    early_dependents: cutlass.Constexpr,
):
    if cutlass.const_expr(early_dependents):
        # the routing kernel after this one may be scheduled now; it waits for this grid to end
        cute.arch.griddepcontrol_launch_dependents()
    tidx, _, _ = cute.arch.thread_idx()
    expert_tile, block, _ = cute.arch.block_idx()
    warp = tidx // 32
    lane = tidx % 32
    vectors = hidden_size // CHUNK
    per_thread = (vectors + ROUTER_THREADS - 1) // ROUTER_THREADS
    row_bytes = hidden_size * 2
    tokens = mX.shape[0]
    experts = mWeight.shape[0]
    first_token = block * token_block
    first_expert = expert_tile * expert_block
    sums_per_thread = expert_block * token_block

    smem = SmemAllocator()
    warp_sums = smem.allocate_tensor(
        cutlass.Float32, cute.make_layout(ROUTER_WARPS * sums_per_thread), 16
    )

    # the weight rows first: no earlier kernel of the forward writes them. The block's experts
    # past E read the last expert's row and write nothing; a thread past a row's end (the last
    # vector of a row that is not a whole number of CTA steps) reloads the last vector and
    # counts none of it
    weights = []  # weights[i][e]: vector i of the thread, expert e of the block
    for i in cutlass.range_constexpr(per_thread):
        vector = cutlass.min(tidx + i * ROUTER_THREADS, vectors - 1)
        row_vectors = []
        for e in cutlass.range_constexpr(expert_block):
            expert = cutlass.min(first_expert + e, experts - 1)
            weight_row = mWeight.iterator.toint() + cutlass.Int64(expert) * row_bytes
            row_vectors.append(load_chunk(weight_row + cutlass.Int64(vector) * (CHUNK * 2)))
        weights.append(row_vectors)

    # x may be the output of the kernel before this one. The block's tokens past T read the
    # last token's row (no branch around the loads: every token's loads of a vector are in
    # flight together) and write nothing
    cute.arch.griddepcontrol_wait()
    x_rows = []
    for t in cutlass.range_constexpr(token_block):
        token = cutlass.min(first_token + t, tokens - 1)
        x_rows.append(mX.iterator.toint() + cutlass.Int64(token) * row_bytes)
    sums = cute.make_rmem_tensor(sums_per_thread, cutlass.Float32)
    sums.fill(0.0)
    for i in cutlass.range_constexpr(per_thread):
        vector = tidx + i * ROUTER_THREADS
        # every thread has vector i but in the row's last, partial CTA step: no branch there, so
        # the loads of several vectors may be in flight together
        if cutlass.const_expr((i + 1) * ROUTER_THREADS <= vectors):
            add_products(sums, weights[i], x_rows, vector, token_block)
        else:
            if vector < vectors:
                add_products(sums, weights[i], x_rows, vector, token_block)
    for s in cutlass.range(sums_per_thread, unroll_full=True):
        total = warp_sum_float(sums[s])
        if lane == 0:
            warp_sums[warp * sums_per_thread + s] = total
    cute.arch.sync_threads()

    if tidx < sums_per_thread:
        expert = first_expert + tidx // token_block
        token = first_token + tidx % token_block
        if expert < experts and token < tokens:
            logit = warp_sums[tidx]
            for w in cutlass.range_constexpr(1, ROUTER_WARPS):
                logit = logit + warp_sums[w * sums_per_thread + tidx]
            if cutlass.const_expr(mBias is not None):
                logit = logit + cutlass.Float32(mBias[expert])
            mLogits[token, expert] = logit.to(mLogits.element_type)


@cute.jit
def router_logits(
    mX: cute.Tensor,
    mWeight: cute.Tensor,
    mBias,
    mLogits: cute.Tensor,
    hidden_size: cutlass.Constexpr,
    token_block: cutlass.Constexpr,
    expert_block: cutlass.Constexpr,
    early_dependents: cutlass.Constexpr,
    stream,
):
    """logits [T, E] = x [T, H] @ weight [E, H]^T (+ bias) in fp32, a CTA per (`expert_block`
    experts, `token_block` tokens), its dependents scheduled at its top with `early_dependents`:
    see the module docstring."""
    blocks = (mX.shape[0] + token_block - 1) // token_block
    if blocks < 1:
        blocks = 1
    expert_tiles = (mWeight.shape[0] + expert_block - 1) // expert_block
    router_logits_kernel(
        mX, mWeight, mBias, mLogits, hidden_size, token_block, expert_block, early_dependents
    ).launch(
        grid=[expert_tiles, blocks, 1],
        block=[ROUTER_THREADS, 1, 1],
        stream=stream,
        use_pdl=True,
    )
