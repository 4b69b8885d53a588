"""Expert-parallel dispatch and combine against the single-GPU dispatcher on the same tokens.

Every rank draws every rank's tokens from one seed, so each can build the single-GPU answer (all
ranks' tokens concatenated in rank order, one LocalDispatcher) and compare its own share of it.
The expert stand-in `2 * row + 1` is exact, so batches and combined outputs compare bitwise.
Dispatchers: "torch" everywhere; "nvshmem" on CUDA ranks with nvshmem4py (else it skips).
"""

from __future__ import annotations

import pytest
import torch
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.dispatch.reference import owner_partials_combine
from megamoe_runtime.dispatch.symmetric_algorithms import SmallBatchDispatch
from megamoe_runtime.distributed import make_expert_parallel_dispatcher, nvshmem_status

pytestmark = pytest.mark.multirank

HIDDEN = 64
NUM_EXPERTS = 16
TOP_K = 4


# the nvshmem dispatcher's variants ("nvshmem" alone: the defaults, the small-batch kernel at
# every size here on up to 2 ranks): the staged dispatch as one kernel or as placement + rows,
# every pair's row over NVLink on its own (no staging), and the partial-sum combine after each
NVSHMEM_OPTIONS = {
    "nvshmem-small": {"small_batch": True},
    "nvshmem-two-kernel": {"small_batch": False},
    "nvshmem-direct": {"stage_remote_rows": False},
    "nvshmem-small-partial": {"small_batch": True, "combine_partial_sums": True},
    "nvshmem-two-kernel-partial": {"small_batch": False, "combine_partial_sums": True},
    "nvshmem-direct-partial": {"stage_remote_rows": False, "combine_partial_sums": True},
}


def make_dispatcher(kind: str, device: torch.device, dtype: torch.dtype, max_tokens: int):
    if kind in NVSHMEM_OPTIONS:
        from megamoe_runtime.dispatch.symmetric import SymmetricDispatcher

        return SymmetricDispatcher(
            NUM_EXPERTS,
            top_k=TOP_K,
            hidden_size=HIDDEN,
            dtype=dtype,
            device=device,
            process_group=torch.distributed.group.WORLD,
            max_tokens_per_rank=max_tokens,
            **NVSHMEM_OPTIONS[kind],
        )
    return make_expert_parallel_dispatcher(
        kind,
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        hidden_size=HIDDEN,
        dtype=dtype,
        device=device,
        process_group=torch.distributed.group.WORLD,
        capacity=None,
        max_tokens_per_rank=max_tokens,
        layer_name="test",
    )


def routed_tokens(tokens_per_rank: list[int], *, seed: int, experts: range, dtype, device):
    """Every rank's (x, topk_ids, topk_weights), ids drawn without repeats from `experts`."""
    generator = torch.Generator().manual_seed(seed)
    shares = []
    for tokens in tokens_per_rank:
        x_TH = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
        choice_TK = torch.rand(tokens, len(experts), generator=generator).argsort(dim=1)[:, :TOP_K]
        ids_TK = (choice_TK + experts.start).to(torch.int32)
        weights_TK = torch.rand(tokens, TOP_K, generator=generator)
        shares.append((x_TH.to(device), ids_TK.to(device), weights_TK.to(device)))
    return shares


def stand_in_experts(rows_MH: torch.Tensor) -> torch.Tensor:
    return rows_MH * 2 + 1


def check_against_single_gpu(
    rank, world_size, device, kind, token_pattern, skewed=False, repeats=1
):
    """Dispatch + combine on this rank's share equal the single-GPU answer, bitwise.

    Rank r sends token_pattern[r % len(token_pattern)] tokens (any world size); `skewed` routes
    every token to rank 0's experts (to the first ranks' where rank 0 holds fewer than top_k)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens_per_rank = [token_pattern[r % len(token_pattern)] for r in range(world_size)]
    experts = range(max(TOP_K, NUM_EXPERTS // world_size) if skewed else NUM_EXPERTS)
    dispatcher = make_dispatcher(kind, device, dtype, max(tokens_per_rank))
    local = NUM_EXPERTS // world_size
    for repeat in range(repeats):
        shares = routed_tokens(
            tokens_per_rank, seed=100 + repeat, experts=experts, dtype=dtype, device=device
        )
        single = LocalDispatcher(NUM_EXPERTS)
        all_x, all_ids, all_weights = (torch.cat(parts) for parts in zip(*shares, strict=True))
        single_batch, single_handle = single.dispatch(all_x, all_ids, all_weights)
        single_y = single.combine(stand_in_experts(single_batch.rows_MH), single_handle)

        batch, handle = dispatcher.dispatch(*shares[rank])
        offsets = single_batch.expert_offsets[rank * local : (rank + 1) * local + 1].cpu()
        assert torch.equal(batch.expert_offsets.cpu(), offsets - offsets[0]), (rank, repeat)
        if isinstance(getattr(dispatcher, "dispatch_algorithm", None), SmallBatchDispatch):
            # the small dispatch clears every epoch-tagged ids word it read (a tagged word has
            # its top bit set), in this epoch's half of the ids buffer (the peers' next dispatch
            # may already be writing the other half)
            half = int(dispatcher.epoch.item()) % 2
            ids_here = dispatcher.buffers["ids"][half * world_size : (half + 1) * world_size]
            assert (ids_here >= 0).all(), (rank, repeat)
        valid = int(offsets[-1] - offsets[0])
        expected_rows = single_batch.rows_MH[int(offsets[0]) : int(offsets[-1])]
        assert torch.equal(batch.rows_MH[:valid], expected_rows), (rank, repeat)
        y_TH = dispatcher.combine(stand_in_experts(batch.rows_MH), handle)
        first = sum(tokens_per_rank[:rank])
        expected_y = single_y[first : first + tokens_per_rank[rank]]
        if kind.endswith("-partial"):  # owners' bf16 partials: one more rounding, other order
            torch.testing.assert_close(y_TH, expected_y, rtol=2e-2, atol=2e-2)
            # and exactly the partial-sum arithmetic of its pure-torch reference
            x_TH, ids_TK, weights_TK = shares[rank]
            out_TKH = stand_in_experts(x_TH).unsqueeze(1).expand(-1, TOP_K, -1)
            expected_partials = owner_partials_combine(
                out_TKH, weights_TK, ids_TK.long() // local, world=world_size, dtype=dtype
            )
            assert torch.equal(y_TH, expected_partials), (rank, repeat)
        else:
            assert torch.equal(y_TH, expected_y), (rank, repeat)


KINDS = ["torch", "nvshmem", *NVSHMEM_OPTIONS]


def skip_unless_runnable(multirank, kind: str) -> None:
    available, reason = nvshmem_status(multirank.device)
    if kind.startswith("nvshmem") and not available:
        pytest.skip(reason)


@pytest.mark.parametrize("kind", KINDS)
def test_uneven_tokens_per_rank(multirank, kind):
    skip_unless_runnable(multirank, kind)
    multirank(check_against_single_gpu, kind, [37, 5])


@pytest.mark.parametrize("kind", KINDS)
def test_rank_with_zero_tokens(multirank, kind):
    skip_unless_runnable(multirank, kind)
    multirank(check_against_single_gpu, kind, [0, 23])


@pytest.mark.parametrize("kind", KINDS)
def test_every_token_to_one_ranks_experts(multirank, kind):
    skip_unless_runnable(multirank, kind)
    multirank(check_against_single_gpu, kind, [19, 31], True)


@pytest.mark.parametrize("kind", KINDS)
def test_repeated_dispatches_reuse_buffers(multirank, kind):
    skip_unless_runnable(multirank, kind)
    multirank(check_against_single_gpu, kind, [64, 48], False, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_many_tokens_spread_the_placement_over_ctas(multirank, kind):
    # 700 x top-4 pairs: the two-kernel placement runs on 11 CTAs (a warp per 32 pairs) and
    # meets at its grid barrier, and the small-batch kernel's one placing CTA walks both
    # sources' 4000 pairs (126 groups of 32 over its 16 warps)
    skip_unless_runnable(multirank, kind)
    multirank(check_against_single_gpu, kind, [700, 300])


@pytest.mark.parametrize("world_size", [4, 8])
def test_reference_on_more_ranks(multirank, world_size):
    tokens = [(11 * rank + 3) % 17 for rank in range(world_size)]
    multirank(check_against_single_gpu, "torch", tokens, False, 2, world_size=world_size)


def check_indivisible_experts_raise(rank, world_size, device):
    with pytest.raises(ValueError, match="divisible"):
        make_expert_parallel_dispatcher(
            "torch",
            num_experts=world_size * 3 + 1,
            top_k=2,
            hidden_size=HIDDEN,
            dtype=torch.float32,
            device=device,
            process_group=torch.distributed.group.WORLD,
            capacity=None,
            max_tokens_per_rank=8,
        )


def test_experts_not_divisible_by_world_raise(multirank):
    multirank(check_indivisible_experts_raise)


# the FP8 wire on every dispatch and combine algorithm (nvshmem only): hidden sizes of whole
# groups of 128 with 16-byte vectors in whole warps (1024), and of a partial last group with
# rows that end mid-warp (448)
FP8_WIRE_ALGORITHMS = {
    name.removeprefix("nvshmem-"): options for name, options in NVSHMEM_OPTIONS.items()
}
FP8_WIRES = {
    "fp8-dispatch": {"dispatch_dtype": "fp8"},
    "fp8-combine": {"combine_dtype": "fp8"},
    "fp8-both": {"dispatch_dtype": "fp8", "combine_dtype": "fp8"},
}
# relative L2 error against the exact bf16 wire, one bound per e4m3 rounding on the way: a
# value rounds by at most 2^-4 of itself (3 mantissa bits); the stand-in experts are linear
FP8_WIRE_RELATIVE_L2 = 2.0**-4


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def check_fp8_wire_against_bf16_wire(rank, world_size, device, algorithm, wire, hidden):
    """The FP8 wire against the exact bf16 wire on the same tokens: the dispatched batch is
    quantize_rows of the bf16 batch, bit for bit; the combine is its pure-torch reference's
    arithmetic bit for bit; the outputs within e4m3 rounding of the bf16 wire's."""
    from megamoe_kernels import quantize_rows
    from megamoe_runtime.dispatch.reference import exact_combine, wire_values
    from megamoe_runtime.dispatch.symmetric import SymmetricDispatcher

    options = FP8_WIRE_ALGORITHMS[algorithm]
    tokens_per_rank = [[37, 5][r % 2] for r in range(world_size)]

    def build(**wire_options):
        return SymmetricDispatcher(
            NUM_EXPERTS,
            top_k=TOP_K,
            hidden_size=hidden,
            dtype=torch.bfloat16,
            device=device,
            process_group=torch.distributed.group.WORLD,
            max_tokens_per_rank=max(tokens_per_rank),
            layer_name=f"fp8-wire-{wire_options != {}}",
            **options,
            **wire_options,
        )

    bf16_wire, quantized = build(), build(**FP8_WIRES[wire])
    fp8_rows = quantized.dispatch_dtype == "fp8"
    assert quantized.fp8_batches == fp8_rows
    local = NUM_EXPERTS // world_size
    generator = torch.Generator().manual_seed(31)
    failures, errors = [], []
    for repeat in range(2):
        shares = []
        for tokens in tokens_per_rank:
            x_TH = torch.randn(tokens, hidden, generator=generator)
            x_TH[:, : hidden // 7] *= 30  # groups of very different ranges in one row
            choice = torch.rand(tokens, NUM_EXPERTS, generator=generator).argsort(1)[:, :TOP_K]
            weights_TK = torch.rand(tokens, TOP_K, generator=generator)
            shares.append(
                (x_TH.bfloat16().to(device), choice.int().to(device), weights_TK.to(device))
            )
        x_TH, ids_TK, weights_TK = shares[rank]
        batch, handle = bf16_wire.dispatch(x_TH, ids_TK, weights_TK)
        out_MH = stand_in_experts(batch.rows_MH)
        y_bf16 = bf16_wire.combine(out_MH, handle)
        fp8_batch, fp8_handle = quantized.dispatch(x_TH, ids_TK, weights_TK)
        valid = int(batch.expert_offsets[-1])
        if not torch.equal(fp8_batch.expert_offsets, batch.expert_offsets):
            failures.append(("offsets", repeat))
        if fp8_rows:
            rows_q, scales_GM = quantize_rows(batch.rows_MH[:valid])
            if not (
                fp8_batch.rows_MH.dtype == torch.float8_e4m3fn
                and torch.equal(
                    fp8_batch.rows_MH[:valid].view(torch.uint8), rows_q.view(torch.uint8)
                )
                and torch.equal(fp8_batch.row_scales_GM[:, :valid], scales_GM)
            ):
                failures.append(("fp8 rows are not quantize_rows of the bf16 rows", repeat))
            # bf16 experts compute on the dequantized rows
            fp8_out_MH = stand_in_experts(fp8_batch.dequantized().rows_MH)
        else:
            if not torch.equal(fp8_batch.rows_MH[:valid], batch.rows_MH[:valid]):
                failures.append(("bf16 rows", repeat))
            fp8_out_MH = out_MH
        y = quantized.combine(fp8_out_MH, fp8_handle)
        # the reference: each pair's output is the stand-in of its token's row as it arrived
        arrived_TH = x_TH
        if fp8_rows:
            arrived_TH = wire_values(x_TH, wire="fp8", dtype=torch.bfloat16).bfloat16()
        out_TKH = stand_in_experts(arrived_TH).unsqueeze(1).expand(-1, TOP_K, -1)
        if "partial" in algorithm:
            expected = owner_partials_combine(
                out_TKH,
                weights_TK,
                ids_TK.long() // local,
                world=world_size,
                dtype=torch.bfloat16,
                wire=quantized.combine_dtype,
            )
        else:
            expected = exact_combine(
                out_TKH, weights_TK, dtype=torch.bfloat16, wire=quantized.combine_dtype
            )
        if not torch.equal(y, expected):
            failures.append(("combine differs from its reference", repeat))
        if y_bf16.numel():
            errors.append(relative_l2(y, y_bf16))
    # checked after the last collective, so one rank's failure cannot hang the others
    assert not failures, (rank, failures)
    roundings = 2 if wire == "fp8-both" else 1
    assert all(0 < error < roundings * FP8_WIRE_RELATIVE_L2 for error in errors), (rank, errors)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [1024, 448])
@pytest.mark.parametrize("wire", list(FP8_WIRES))
@pytest.mark.parametrize("algorithm", list(FP8_WIRE_ALGORITHMS))
def test_fp8_wire_against_the_exact_bf16_wire(multirank, algorithm, wire, hidden):
    skip_unless_runnable(multirank, "nvshmem")
    multirank(check_fp8_wire_against_bf16_wire, algorithm, wire, hidden)
