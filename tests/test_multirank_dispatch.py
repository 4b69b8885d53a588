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
