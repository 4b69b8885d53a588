"""The combine on one GPU (sm_90a): each token's top-k expert rows, weighted, summed in a fixed
order.

combine_pairs: one thread per (token, 16-byte chunk of the hidden dimension), grid-stride over
a grid of one wave at most: `sms` x combine_ctas_per_sm(top_k) CTAs, as many as are resident at
once (a grid past one wave ran its last CTAs' whole strides on a fraction of the SMs: one
wave takes 9-14% less time at qwen3-30b-a3b and gpt-oss-120b prefill):
y[t] = 0 + weight[t, 0] x out[row[t, 0]] + ... + weight[t, K-1] x out[row[t, K-1]] in fp32, k in
that order, each product rounded to fp32 on its own (mul.rn, never contracted into an fma),
rounded to bf16; with an addend (the shared experts' output), that bf16 sum + addend[t] in
fp32, rounded to bf16 again: the bits of `y + shared` in bf16. It is the arithmetic of
megamoe_runtime's torch combine (weighted_sum_over_topk) and of the expert-parallel
combine_reduce, so they give the same bits. Without weights (they were
applied in the down GEMM's epilogue) the rows are summed as they are. No atomics: deterministic.

Layouts: expert_out [M, H] bf16 row-major (rows past the valid count never read), row_of_pair
int32 [T, top_k] (each < M), weights float32 [T, top_k] (optional), addend and y [T, H] bf16;
H a multiple of 8, rows 16-byte aligned; token_count int32 [1] (optional, token_count.py): only
the first min(token_count[0], T) tokens are combined (y's rows past them are left as they are).
"""

import cutlass
import cutlass.cute as cute

from .ep_combine import add_weighted
from .ep_sync import thread_position
from .row_vectors import CHUNK, load_chunk, store_chunk
from .token_count import counted_tokens

COMBINE_THREADS = 256


def combine_ctas_per_sm(top_k: int) -> int:
    """The combine's CTAs resident on an SM at once, which its launch bounds guarantee: a thread
    holds top_k 16-byte loads in flight, in 32 registers up to top_k = 2 (8 CTAs fill the 64K
    registers) and 40 above (6 CTAs; at 32 a top-8 thread spills)."""
    return 8 if top_k <= 2 else 6


@cute.kernel
def combine_pairs_kernel(
    mExpertOut: cute.Tensor,
    mRowOfPair: cute.Tensor,
    mWeights,
    mAddend,
    mY: cute.Tensor,
    mTokenCount,
    top_k: cutlass.Constexpr,
):
    tidx, bidx, grid, _, _ = thread_position()
    # launched with programmatic dependent launch: set up while the down GEMM drains, then wait
    # for it (and everything before it) before reading
    cute.arch.griddepcontrol_wait()
    tokens = counted_tokens(mY.shape[0], mTokenCount)
    hidden = mY.shape[1]
    chunks = hidden // CHUNK
    row_bytes = cutlass.Int64(hidden) * 2
    out_address = mExpertOut.iterator.toint()
    y_address = mY.iterator.toint()
    for item in range(bidx * COMBINE_THREADS + tidx, tokens * chunks, grid * COMBINE_THREADS):
        token = item // chunks
        chunk_bytes = cutlass.Int64(item - token * chunks) * (CHUNK * 2)
        rows = []
        for k in cutlass.range_constexpr(top_k):
            rows.append(mRowOfPair[token, k])
        values = []
        for k in cutlass.range_constexpr(top_k):
            values.append(
                load_chunk(out_address + cutlass.Int64(rows[k]) * row_bytes + chunk_bytes)
            )
        total = cute.make_rmem_tensor(CHUNK, cutlass.Float32)
        total.fill(0.0)
        contribution = cute.make_rmem_tensor(CHUNK, cutlass.Float32)
        for k in cutlass.range_constexpr(top_k):
            if cutlass.const_expr(mWeights is not None):
                add_weighted(total, contribution, values[k], mWeights[token, k])
            else:
                contribution.store(values[k].to(cutlass.Float32))
                for i in cutlass.range_constexpr(CHUNK):
                    total[i] = total[i] + contribution[i]
        if cutlass.const_expr(mAddend is not None):
            addend_address = mAddend.iterator.toint() + cutlass.Int64(token) * row_bytes
            contribution.store(load_chunk(addend_address + chunk_bytes).to(cutlass.Float32))
            total.store(total.load().to(cutlass.BFloat16).to(cutlass.Float32))
            for i in cutlass.range_constexpr(CHUNK):
                total[i] = total[i] + contribution[i]
        store_chunk(y_address + cutlass.Int64(token) * row_bytes + chunk_bytes, total)


@cute.jit
def combine_pairs(
    mExpertOut: cute.Tensor,
    mRowOfPair: cute.Tensor,
    mWeights,
    mAddend,
    mY: cute.Tensor,
    mTokenCount,
    top_k: cutlass.Constexpr,
    sms: cutlass.Constexpr,
    stream,
):
    items = mY.shape[0] * (mY.shape[1] // CHUNK)
    grid = (items + COMBINE_THREADS - 1) // COMBINE_THREADS
    ctas_per_sm = combine_ctas_per_sm(top_k)
    if grid > sms * ctas_per_sm:
        grid = sms * ctas_per_sm
    if grid < 1:
        grid = 1
    combine_pairs_kernel(mExpertOut, mRowOfPair, mWeights, mAddend, mY, mTokenCount, top_k).launch(
        grid=[grid, 1, 1],
        block=[COMBINE_THREADS, 1, 1],
        stream=stream,
        use_pdl=True,
        # launch bounds: at most 65536 / (ctas_per_sm x COMBINE_THREADS) registers a thread
        max_number_threads=[COMBINE_THREADS, 1, 1],
        min_blocks_per_mp=ctas_per_sm,
        # no shared memory: all of it L1 (given, the compile does not ask a GPU for a default)
        preferred_smem_carveout=0,
    )
