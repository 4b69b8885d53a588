"""The DeepEP adapter against the single-GPU dispatcher, on the torch.distributed stand-in for
DeepEP's buffers (fake_deep_ep.py), so it runs on CPU ranks.

Every rank draws every rank's tokens from one seed and builds the single-GPU answer (all ranks'
tokens concatenated in rank order, one LocalDispatcher). The expert stand-in `2 * row + 1` is
exact and row by row, so it runs on a masked batch's whole buffer: the garbage (NaN) past each
expert's count must reach no output. Normal mode's combine is the owner-partials arithmetic
(each rank's partial rounded to bf16, the partials added in fp32): on V1 bitwise equal to
`owner_partials_combine`. Low-latency mode's is the single-GPU combine's: bitwise equal to it.
"""

from __future__ import annotations

import fake_deep_ep as fake
import pytest
import torch
import torch.distributed as dist
from megamoe_kernels.reference import relative_l2_error
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.dispatch.deepep import DeepEPDispatcher
from megamoe_runtime.dispatch.reference import owner_partials_combine
from megamoe_runtime.expert_batch import ExpertBatch

pytestmark = pytest.mark.multirank

HIDDEN = 128
NUM_EXPERTS = 16
TOP_K = 4
MAX_TOKENS = 64

KINDS = {
    # name: (DeepEP API, mode, FP8 dispatch, hidden size: DeepEP's low-latency FP8 takes 512s)
    "v1-normal": ("v1", "normal", False, HIDDEN),
    "v1-normal-fp8": ("v1", "normal", True, HIDDEN),
    "v1-low-latency": ("v1", "low_latency", False, HIDDEN),
    "v1-low-latency-fp8": ("v1", "low_latency", True, 512),
    "v2-normal": ("v2", "normal", False, HIDDEN),
}


def make_buffer(api: str, mode: str, *, hidden: int, experts: int = NUM_EXPERTS, smaller=0):
    """A stand-in buffer sized as DeepEP's docs size one (less `smaller` bytes)."""
    group = dist.group.WORLD
    world = dist.get_world_size()
    if api == "v2":
        needed = fake.ElasticBuffer.get_buffer_size_hint(group, MAX_TOKENS, hidden, TOP_K)
        return fake.ElasticBuffer(
            group, num_bytes=needed - smaller, num_max_tokens_per_rank=MAX_TOKENS
        )
    configs = (fake.Buffer.get_dispatch_config(world), fake.Buffer.get_combine_config(world))
    nvl = max(config.get_nvl_buffer_size_hint(hidden * 2, world) for config in configs)
    if mode == "normal":
        return fake.Buffer(group, num_nvl_bytes=nvl - smaller)
    rdma = fake.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, hidden, world, experts)
    return fake.Buffer(
        group,
        num_nvl_bytes=nvl,
        num_rdma_bytes=rdma - smaller,
        low_latency_mode=True,
        num_qps_per_rank=experts // world,
    )


def make_dispatcher(kind: str, buffer=None) -> DeepEPDispatcher:
    api, mode, fp8, hidden = KINDS[kind]
    return DeepEPDispatcher(
        make_buffer(api, mode, hidden=hidden) if buffer is None else buffer,
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        hidden_size=hidden,
        mode=mode,
        max_tokens_per_rank=MAX_TOKENS if mode == "low_latency" else None,
        fp8_dispatch=fp8,
    )


def routed_tokens(tokens_per_rank: list[int], *, seed: int, experts: range, hidden: int):
    """Every rank's bf16 (x, topk_ids, topk_weights), ids drawn without repeats from `experts`."""
    generator = torch.Generator().manual_seed(seed)
    shares = []
    for tokens in tokens_per_rank:
        x_TH = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
        choice_TK = torch.rand(tokens, len(experts), generator=generator).argsort(dim=1)[:, :TOP_K]
        ids_TK = (choice_TK + experts.start).to(torch.int32)
        weights_TK = torch.rand(tokens, TOP_K, generator=generator)
        shares.append((x_TH, ids_TK, weights_TK))
    return shares


def stand_in_experts(batch) -> torch.Tensor:
    rows_MH = batch.rows_MH
    if batch.row_scales_GM is not None:
        from megamoe_kernels import dequantize_rows

        rows_MH = dequantize_rows(rows_MH, batch.row_scales_GM)
    return (rows_MH.float() * 2 + 1).to(torch.bfloat16)


def single_gpu_answer(shares, *, fp8: bool):
    """The single-GPU batch and combined output of all ranks' tokens."""
    all_x, all_ids, all_weights = (torch.cat(parts) for parts in zip(*shares, strict=True))
    single = LocalDispatcher(NUM_EXPERTS)
    batch, handle = single.dispatch(all_x, all_ids, all_weights)
    if fp8:  # the tokens as megamoe quantizes them (what FP8 normal-mode dispatch sends)
        from megamoe_kernels import quantize_rows

        rows_q, scales_GM = quantize_rows(batch.rows_MH)
        out = stand_in_experts(
            ExpertBatch(
                rows_MH=rows_q, expert_offsets=batch.expert_offsets, row_scales_GM=scales_GM
            )
        )
    else:
        out = stand_in_experts(batch)
    return batch, single.combine(out, handle)


def check_against_single_gpu(
    rank, world_size, device, kind, token_pattern, skewed=False, repeats=1
):
    """Dispatch + combine through the adapter on this rank's share of the tokens.

    Rank r sends token_pattern[r % len(token_pattern)] tokens; `skewed` routes every token to
    rank 0's experts (the first ranks' where rank 0 holds fewer than top_k)."""
    _, mode, fp8, hidden = KINDS[kind]
    tokens_per_rank = [token_pattern[r % len(token_pattern)] for r in range(world_size)]
    local = NUM_EXPERTS // world_size
    experts = range(max(TOP_K, local) if skewed else NUM_EXPERTS)
    dispatcher = make_dispatcher(kind)
    assert dispatcher.num_local_experts == local
    results = []
    for repeat in range(repeats):
        shares = routed_tokens(tokens_per_rank, seed=100 + repeat, experts=experts, hidden=hidden)
        single_batch, single_y = single_gpu_answer(shares, fp8=fp8 and mode == "normal")
        x_TH, ids_TK, weights_TK = shares[rank]
        batch, handle = dispatcher.dispatch(x_TH, ids_TK, weights_TK)
        y_TH = dispatcher.combine(stand_in_experts(batch), handle)
        first = sum(tokens_per_rank[:rank])
        mine = slice(first, first + tokens_per_rank[rank])
        offsets = single_batch.expert_offsets[rank * local : (rank + 1) * local + 1]
        results.append((batch, y_TH, single_batch, single_y[mine], offsets, shares))
    fail_together(lambda: check_results(results, rank, world_size, kind))


def fail_together(check) -> None:
    """Runs `check` after the last exchange; if it fails on any rank, every rank raises, so
    no rank waits for another at the fixture's barrier (under torchrun) while it runs on."""
    try:
        check()
        failure = None
    except AssertionError as error:
        failure = error
    failed = torch.tensor([failure is not None], dtype=torch.int64)
    fake.wait_for_peers(
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, async_op=True), "the verdict", None
    )
    if failure is not None:
        raise failure
    if failed.item():
        raise AssertionError("the check failed on another rank")


def check_results(results, rank, world_size, kind) -> None:
    api, mode, fp8, _ = KINDS[kind]
    for batch, y_TH, single_batch, expected_y, offsets, shares in results:
        x_TH, ids_TK, weights_TK = shares[rank]
        if mode == "normal":
            assert not batch.is_masked
            assert torch.equal(batch.expert_offsets, offsets - offsets[0])
            expected_rows = single_batch.rows_MH[int(offsets[0]) : int(offsets[-1])]
            if fp8:
                from megamoe_kernels import quantize_rows

                expected_rows = quantize_rows(expected_rows)[0]
                assert torch.equal(batch.rows_MH.view(torch.uint8), expected_rows.view(torch.uint8))
            elif api == "v1":  # V1 receives source rank by source rank, in token order
                assert torch.equal(batch.rows_MH, expected_rows)
            else:  # V2 receives in an arbitrary order: each expert's rows as a set
                assert_same_rows_per_expert(batch.rows_MH, batch.expert_offsets, expected_rows)
            out_TKH = stand_in_experts_of_tokens(x_TH, fp8=fp8)
            expected_partials = owner_partials_combine(
                out_TKH,
                weights_TK,
                ids_TK.long() // (NUM_EXPERTS // world_size),
                world=world_size,
                dtype=torch.bfloat16,
            )
            if api == "v1":
                assert torch.equal(y_TH, expected_partials)
            torch.testing.assert_close(y_TH, expected_y, rtol=2e-2, atol=2e-2)
        else:
            assert batch.is_masked and batch.expert_stride == world_size * MAX_TOKENS
            counts = offsets.diff()
            assert torch.equal(batch.expert_counts, counts.to(torch.int32))
            if not fp8:  # (FP8: DeepEP's cast, not megamoe's: checked through y below)
                rows_ESH = batch.rows_MH.view(batch.num_experts, batch.expert_stride, -1)
                valid = torch.arange(batch.expert_stride) < counts[:, None]
                # the arrival order inside an expert is DeepEP's: each expert's rows as a set
                assert_same_rows_per_expert(
                    rows_ESH[valid],
                    offsets - offsets[0],
                    single_batch.rows_MH[int(offsets[0]) : int(offsets[-1])],
                )
            if fp8:
                assert relative_l2_error(y_TH, expected_y) < 0.05
            else:
                assert torch.equal(y_TH, expected_y)
        assert torch.isfinite(y_TH).all()


def assert_same_rows_per_expert(rows_MH, offsets, expected_MH) -> None:
    for expert in range(offsets.numel() - 1):
        segment = slice(int(offsets[expert]), int(offsets[expert + 1]))
        got, expected = rows_MH[segment].float(), expected_MH[segment].float()
        assert torch.equal(torch.unique(got, dim=0), torch.unique(expected, dim=0)), expert


def stand_in_experts_of_tokens(x_TH: torch.Tensor, *, fp8: bool) -> torch.Tensor:
    """[T, K, H]: every (token, k)'s stand-in output (the same for each k: a token's row)."""
    rows = x_TH
    if fp8:
        from megamoe_kernels import dequantize_rows, quantize_rows

        rows = dequantize_rows(*quantize_rows(x_TH))
    out_TH = (rows.float() * 2 + 1).to(torch.bfloat16)
    return out_TH.unsqueeze(1).expand(-1, TOP_K, -1)


@pytest.mark.parametrize("kind", KINDS)
def test_deepep_uneven_tokens_per_rank(multirank, kind):
    multirank(check_against_single_gpu, kind, [37, 5])


@pytest.mark.parametrize("kind", KINDS)
def test_deepep_rank_with_zero_tokens(multirank, kind):
    multirank(check_against_single_gpu, kind, [0, 23])


@pytest.mark.parametrize("kind", KINDS)
def test_deepep_every_token_to_one_ranks_experts(multirank, kind):
    multirank(check_against_single_gpu, kind, [19, MAX_TOKENS], True)


@pytest.mark.parametrize("kind", KINDS)
def test_deepep_repeated_dispatches(multirank, kind):
    multirank(check_against_single_gpu, kind, [64, 48], False, 3)


@pytest.mark.parametrize("kind", ["v1-normal", "v1-low-latency", "v2-normal"])
def test_deepep_on_more_ranks(multirank, kind):
    tokens = [(11 * rank + 3) % 17 for rank in range(4)]
    multirank(check_against_single_gpu, kind, tokens, True, 2, world_size=4)


def check_cached_dispatch_reuses_the_layout(rank, world_size, device, kind):
    """A cached dispatch sends new rows along the first dispatch's layout: no layout call and
    no new receive counts, and the same batch a fresh dispatch of those rows gives."""
    hidden = KINDS[kind][3]
    dispatcher = make_dispatcher(kind)
    tokens_per_rank = [(9 * r + 20) % 31 for r in range(world_size)]
    shares = routed_tokens(tokens_per_rank, seed=7, experts=range(NUM_EXPERTS), hidden=hidden)
    x_TH, ids_TK, weights_TK = shares[rank]
    batch, handle = dispatcher.dispatch(x_TH, ids_TK, weights_TK)
    y_first = dispatcher.combine(stand_in_experts(batch), handle)
    calls_before = len(dispatcher.buffer.calls)
    new_x_TH = torch.randn(x_TH.shape, generator=torch.Generator().manual_seed(8 + rank))
    new_x_TH = new_x_TH.to(torch.bfloat16)
    cached_batch, cached_handle = dispatcher.cached_dispatch(new_x_TH, handle)
    cached_calls = dispatcher.buffer.calls[calls_before:]
    y_cached = dispatcher.combine(stand_in_experts(cached_batch), cached_handle)
    fresh_batch, fresh_handle = dispatcher.dispatch(new_x_TH, ids_TK, weights_TK)
    y_fresh = dispatcher.combine(stand_in_experts(fresh_batch), fresh_handle)

    def check() -> None:
        assert cached_calls == ["cached_dispatch"]
        assert cached_handle is handle
        assert torch.equal(cached_batch.expert_offsets, fresh_batch.expert_offsets)
        if dispatcher.api == "v1":
            assert torch.equal(cached_batch.rows_MH, fresh_batch.rows_MH)
        else:
            assert_same_rows_per_expert(
                cached_batch.rows_MH.view(torch.uint8),
                cached_batch.expert_offsets,
                fresh_batch.rows_MH.view(torch.uint8),
            )
        # the rows are the new ones, and each output is its own row's: the order is immaterial
        assert torch.equal(y_cached, y_fresh)
        assert not torch.equal(y_cached, y_first) or x_TH.shape[0] == 0

    fail_together(check)


@pytest.mark.parametrize("kind", ["v1-normal", "v1-normal-fp8", "v2-normal"])
def test_deepep_cached_dispatch_reuses_the_layout(multirank, kind):
    multirank(check_cached_dispatch_reuses_the_layout, kind)


def check_one_buffer_serves_both_modes(rank, world_size, device):
    """Prefill then decode then prefill on one low_latency_mode buffer: the low-latency
    dispatch after normal-mode kernels cleans the buffer first (DeepEP requires it)."""
    buffer = make_buffer("v1", "low_latency", hidden=HIDDEN)
    prefill = make_dispatcher("v1-normal", buffer)
    decode = make_dispatcher("v1-low-latency", buffer)
    tokens_per_rank = [(5 * r + 12) % 29 for r in range(world_size)]
    results = []
    for step, dispatcher in enumerate((prefill, decode, decode, prefill, decode)):
        shares = routed_tokens(
            tokens_per_rank, seed=30 + step, experts=range(NUM_EXPERTS), hidden=HIDDEN
        )
        _, single_y = single_gpu_answer(shares, fp8=False)
        batch, handle = dispatcher.dispatch(*shares[rank])
        y_TH = dispatcher.combine(stand_in_experts(batch), handle)
        first = sum(tokens_per_rank[:rank])
        results.append((y_TH, single_y[first : first + tokens_per_rank[rank]]))

    def check() -> None:
        assert buffer.calls.count("clean_low_latency_buffer") == 2
        for y_TH, expected in results:
            torch.testing.assert_close(y_TH, expected, rtol=2e-2, atol=2e-2)

    fail_together(check)


def test_deepep_one_buffer_serves_normal_and_low_latency(multirank):
    multirank(check_one_buffer_serves_both_modes)


def check_bad_input_is_refused(rank, world_size, device):
    """Each refusal is local to a rank and comes before any DeepEP call."""
    normal = make_buffer("v1", "normal", hidden=HIDDEN)
    low_latency = make_buffer("v1", "low_latency", hidden=HIDDEN)
    elastic = make_buffer("v2", "normal", hidden=HIDDEN)

    def build(buffer, **options):
        settings = {"num_experts": NUM_EXPERTS, "top_k": TOP_K, "hidden_size": HIDDEN} | options
        return DeepEPDispatcher(buffer, **settings)

    with pytest.raises(TypeError, match=r"deep_ep.Buffer .* or a deep_ep.ElasticBuffer"):
        build(LocalDispatcher(NUM_EXPERTS))
    with pytest.raises(ValueError, match="built with low_latency_mode=True"):
        build(normal, mode="low_latency", max_tokens_per_rank=MAX_TOKENS)
    with pytest.raises(ValueError, match="no low-latency API"):
        build(elastic, mode="low_latency", max_tokens_per_rank=MAX_TOKENS)
    with pytest.raises(ValueError, match="mode must be one of"):
        build(normal, mode="fast")
    # too small for this layer
    with pytest.raises(ValueError, match=r"normal mode at hidden 128 on \d ranks needs"):
        build(make_buffer("v1", "normal", hidden=HIDDEN, smaller=128))
    with pytest.raises(ValueError, match=r"normal mode at hidden 256"):
        build(normal, hidden_size=256)
    with pytest.raises(ValueError, match="get_low_latency_rdma_size_hint"):
        build(
            make_buffer("v1", "low_latency", hidden=HIDDEN, smaller=BUFFER_STEP),
            mode="low_latency",
            max_tokens_per_rank=MAX_TOKENS,
        )
    with pytest.raises(ValueError, match="get_low_latency_rdma_size_hint"):
        build(low_latency, mode="low_latency", max_tokens_per_rank=2 * MAX_TOKENS)
    with pytest.raises(ValueError, match="ElasticBuffer.get_buffer_size_hint"):
        build(make_buffer("v2", "normal", hidden=HIDDEN, smaller=fake.ELASTIC_ALIGNMENT))
    with pytest.raises(ValueError, match="divisible"):
        build(normal, num_experts=world_size * 3 + 1)
    with pytest.raises(ValueError, match="needs max_tokens_per_rank"):
        build(low_latency, mode="low_latency")
    with pytest.raises(ValueError, match="divisible by 512 with FP8 dispatch"):
        build(low_latency, mode="low_latency", max_tokens_per_rank=MAX_TOKENS, fp8_dispatch=True)
    # at dispatch, before any DeepEP call
    decode = build(low_latency, mode="low_latency", max_tokens_per_rank=MAX_TOKENS)
    prefill = build(normal)
    calls = len(low_latency.calls), len(normal.calls)
    x_TH, ids_TK, weights_TK = routed_tokens(
        [MAX_TOKENS + 1], seed=3, experts=range(NUM_EXPERTS), hidden=HIDDEN
    )[0]
    with pytest.raises(ValueError, match=r"65 tokens exceed max_tokens_per_rank=64"):
        decode.dispatch(x_TH, ids_TK, weights_TK)
    with pytest.raises(TypeError, match="DeepEP dispatches bf16 tokens"):
        prefill.dispatch(x_TH.float(), ids_TK, weights_TK)
    with pytest.raises(ValueError, match="top_k 3; the dispatcher was built for top_k=4"):
        prefill.dispatch(x_TH, ids_TK[:, :3], weights_TK[:, :3])
    with pytest.raises(ValueError, match="hidden size 64"):
        prefill.dispatch(x_TH[:, :64], ids_TK, weights_TK)
    with pytest.raises(ValueError, match="no layout to cache"):
        decode.cached_dispatch(x_TH, None)
    assert (len(low_latency.calls), len(normal.calls)) == calls


BUFFER_STEP = fake.BUFFER_ALIGNMENT


def test_deepep_bad_input_is_refused_before_any_launch(multirank):
    multirank(check_bad_input_is_refused)


DEEPSEEK_V3_JSON = {
    "model_type": "deepseek_v3",
    "hidden_size": HIDDEN,
    "moe_intermediate_size": 64,
    "n_routed_experts": NUM_EXPERTS,
    "num_experts_per_tok": TOP_K,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
}


def deepseek_v3_checkpoint() -> dict[str, torch.Tensor]:
    """A DeepSeek-V3-style block's tensors under their Hugging Face names, the same on every
    rank (random weights and correction bias)."""
    from megamoe_torch import MegaMoE, MegaMoEConfig
    from megamoe_torch.hf import hf_state_dict_from_megamoe
    from megamoe_torch.hf.families import read_hf_config

    _, fields = read_hf_config(DEEPSEEK_V3_JSON)
    torch.manual_seed(7)
    source = MegaMoE(MegaMoEConfig(**fields), dtype=torch.bfloat16)
    with torch.no_grad():
        source.e_score_correction_bias.uniform_(-0.1, 0.1)
    return hf_state_dict_from_megamoe(source.state_dict(), family="deepseek_v3")


def check_layer_through_deepep(rank, world_size, device, kind, token_pattern):
    """from_hf_state_dict(..., dispatcher=DeepEPDispatcher) equals the single-GPU layer built
    from the same checkpoint, over repeated forwards (bf16: within bf16 tolerance)."""
    from megamoe_torch import from_hf_state_dict

    checkpoint = deepseek_v3_checkpoint()
    single = from_hf_state_dict(checkpoint, DEEPSEEK_V3_JSON, backend="reference")
    dispatcher = make_dispatcher(kind)
    parallel = from_hf_state_dict(
        checkpoint, DEEPSEEK_V3_JSON, backend="reference", dispatcher=dispatcher
    )
    tokens_per_rank = [token_pattern[r % len(token_pattern)] for r in range(world_size)]
    generator = torch.Generator().manual_seed(11)
    results = []
    for _ in range(3):
        xs = [
            torch.randn(t, HIDDEN, generator=generator).to(torch.bfloat16) for t in tokens_per_rank
        ]
        with torch.no_grad():
            y_single = single(torch.cat(xs))
            y = parallel(xs[rank])
        first = sum(tokens_per_rank[:rank])
        results.append((y, y_single[first : first + tokens_per_rank[rank]]))

    def check() -> None:
        assert parallel.dispatcher is dispatcher and parallel.dispatcher_reason.startswith(
            "injected: DeepEP"
        )
        assert parallel.w13.shape[0] == NUM_EXPERTS // world_size
        assert list(parallel.local_experts) == list(
            range(rank * NUM_EXPERTS // world_size, (rank + 1) * NUM_EXPERTS // world_size)
        )
        for y, expected in results:
            if KINDS[kind][2]:  # the tokens cross as e4m3: FP8's error, not bf16's
                assert relative_l2_error(y, expected) < 0.05
            else:
                torch.testing.assert_close(y, expected, rtol=2e-2, atol=2e-2)

    fail_together(check)


@pytest.mark.parametrize("kind", ["v1-normal", "v1-normal-fp8", "v1-low-latency", "v2-normal"])
def test_deepep_layer_from_a_checkpoint_equals_single_gpu(multirank, kind):
    multirank(check_layer_through_deepep, kind, [40, 0, 17])


@pytest.mark.parametrize("kind", ["v1-normal", "v1-low-latency"])
def test_deepep_layer_on_more_ranks(multirank, kind):
    multirank(check_layer_through_deepep, kind, [5, 17, 0, 8], world_size=4)


def check_layer_refuses_a_dispatcher_that_disagrees(rank, world_size, device):
    from megamoe_torch import MegaMoE, MegaMoEConfig
    from megamoe_torch.hf.families import read_hf_config

    _, fields = read_hf_config(DEEPSEEK_V3_JSON)
    config = MegaMoEConfig(**fields, backend="reference")
    dispatcher = make_dispatcher("v1-normal")
    # every rank builds every one-rank group, in the same order
    own_group = [dist.new_group([r]) for r in range(world_size)][rank]
    with pytest.raises(ValueError, match=r"process_group holds ranks \[\d\] but the dispatcher"):
        MegaMoE(config, process_group=own_group, dispatcher=dispatcher)
    with pytest.raises(ValueError, match="built for num_experts=16, the layer has num_experts=32"):
        MegaMoE(MegaMoEConfig(**(fields | {"num_experts": 32})), dispatcher=dispatcher)
    with pytest.raises(ValueError, match="leave config.dispatcher at 'auto'"):
        MegaMoE(MegaMoEConfig(**fields, dispatcher="torch"), dispatcher=dispatcher)
    with pytest.raises(ValueError, match="runs megamoe's own"):
        MegaMoE(config, process_group=dist.group.WORLD).use_dispatcher(dispatcher)
    layer = MegaMoE(config, process_group=dist.group.WORLD, dispatcher=dispatcher)
    assert layer.process_group is dist.group.WORLD and layer.expert_parallel
    with pytest.raises(
        ValueError, match="built for hidden_size=256, the layer has hidden_size=128"
    ):
        layer.use_dispatcher(
            DeepEPDispatcher(
                make_buffer("v1", "normal", hidden=256),
                num_experts=NUM_EXPERTS,
                top_k=TOP_K,
                hidden_size=256,
            )
        )
    # a float32 layer: DeepEP moves bf16, refused before anything is sent
    calls = len(dispatcher.buffer.calls)
    with pytest.raises(TypeError, match="DeepEP dispatches bf16 tokens"), torch.no_grad():
        layer(torch.randn(3, HIDDEN))
    assert len(dispatcher.buffer.calls) == calls


def test_deepep_layer_refuses_a_dispatcher_that_disagrees(multirank):
    multirank(check_layer_refuses_a_dispatcher_that_disagrees)


def check_layer_with_expert_biases_on_masked_batches(rank, world_size, device):
    """A layer with expert biases runs the masked batch of a low-latency dispatcher on the
    reference backend (the cutedsl kernels take tight batches), and equals the single-GPU
    layer."""
    from megamoe_torch import MegaMoE, MegaMoEConfig

    config = MegaMoEConfig(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        expert_bias=True,
        backend="reference",
    )
    torch.manual_seed(5)
    single = MegaMoE(config, dtype=torch.bfloat16)
    parallel = MegaMoE(config, dispatcher=make_dispatcher("v1-low-latency"), dtype=torch.bfloat16)
    parallel.load_full_state_dict(single.state_dict())
    tokens_per_rank = [(13 * r + 9) % 40 for r in range(world_size)]
    generator = torch.Generator().manual_seed(12)
    xs = [torch.randn(t, HIDDEN, generator=generator).to(torch.bfloat16) for t in tokens_per_rank]
    with torch.no_grad():
        y_single = single(torch.cat(xs))
        y = parallel(xs[rank])
    first = sum(tokens_per_rank[:rank])
    expected = y_single[first : first + tokens_per_rank[rank]]
    fail_together(lambda: torch.testing.assert_close(y, expected, rtol=2e-2, atol=2e-2))


def test_deepep_low_latency_layer_with_expert_biases(multirank):
    multirank(check_layer_with_expert_biases_on_masked_batches)


def check_layer_switches_between_prefill_and_decode(rank, world_size, device):
    """One layer, one low_latency_mode buffer: prefill through the normal-mode dispatcher,
    decode through the low-latency one, and back, each forward equal to the single-GPU one."""
    from megamoe_torch import from_hf_state_dict

    checkpoint = deepseek_v3_checkpoint()
    single = from_hf_state_dict(checkpoint, DEEPSEEK_V3_JSON, backend="reference")
    buffer = make_buffer("v1", "low_latency", hidden=HIDDEN)
    prefill = make_dispatcher("v1-normal", buffer)
    decode = make_dispatcher("v1-low-latency", buffer)
    layer = from_hf_state_dict(
        checkpoint, DEEPSEEK_V3_JSON, backend="reference", dispatcher=prefill
    )
    generator = torch.Generator().manual_seed(21)
    results = []
    for step, dispatcher in enumerate((prefill, decode, decode, prefill)):
        layer.use_dispatcher(dispatcher)
        tokens_per_rank = [(7 * r + 3 * step + 5) % 30 for r in range(world_size)]
        xs = [
            torch.randn(t, HIDDEN, generator=generator).to(torch.bfloat16) for t in tokens_per_rank
        ]
        with torch.no_grad():
            y_single = single(torch.cat(xs))
            y = layer(xs[rank])
        first = sum(tokens_per_rank[:rank])
        results.append(
            (layer.dispatcher_reason, y, y_single[first : first + tokens_per_rank[rank]])
        )

    def check() -> None:
        assert [reason.split(", ")[1] for reason, _, _ in results] == [
            "normal mode",
            "low-latency mode",
            "low-latency mode",
            "normal mode",
        ]
        assert buffer.calls.count("clean_low_latency_buffer") == 1
        for _, y, expected in results:
            torch.testing.assert_close(y, expected, rtol=2e-2, atol=2e-2)

    fail_together(check)


def test_deepep_layer_switches_between_prefill_and_decode(multirank):
    multirank(check_layer_switches_between_prefill_and_decode)
