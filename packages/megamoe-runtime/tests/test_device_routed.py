"""The device routing, dispatch and combine kernels against the torch path (route +
LocalDispatcher + weighted_sum_over_topk), which is their oracle: same ids and weights up to
ties, then the same batch, offsets, pair rows and combine bits on the kernel's own routing; and
given experts (a model's own top-k, DeepSeek-V4's hash layers) placed as LocalDispatcher places
the same ids, their weights as given or each given expert's score as weights_of_chosen
computes it."""

from __future__ import annotations

import pytest
import torch
from megamoe_runtime.dispatch.device_routed import DeviceRoutedDispatcher, device_routing_status
from megamoe_runtime.dispatch.local import (
    LocalDispatcher,
    LocalHandle,
    row_weights_of,
    weighted_sum_over_topk,
)
from megamoe_runtime.routing import RouterConfig, route, scores_of, weights_of_chosen
from torch.profiler import ProfilerActivity, profile

pytestmark = pytest.mark.gpu


def _needs_kernels(router: RouterConfig, hidden: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ok, why = device_routing_status(
        router, hidden_size=hidden, dtype=torch.bfloat16, device=torch.device("cuda")
    )
    if not ok:
        pytest.skip(why)


ROUTERS = {
    "qwen3": RouterConfig(num_experts=128, top_k=8),
    "mixtral": RouterConfig(num_experts=8, top_k=2),
    "top_k_equals_experts": RouterConfig(num_experts=8, top_k=8),
    "odd_experts": RouterConfig(num_experts=40, top_k=6, renormalize=False),
    "dsv3": RouterConfig(
        num_experts=256,
        top_k=8,
        scoring="sigmoid",
        num_groups=8,
        top_groups=4,
        routed_scaling_factor=2.5,
        use_correction_bias=True,
    ),
    "dsv3_dropped_zero": RouterConfig(
        num_experts=256,
        top_k=8,
        scoring="sigmoid",
        num_groups=8,
        top_groups=4,
        use_correction_bias=True,
        dropped_group_score=0.0,
    ),
    "small_groups": RouterConfig(
        num_experts=64, top_k=4, scoring="sigmoid", num_groups=8, top_groups=3, renormalize=False
    ),
    "sigmoid_plain": RouterConfig(num_experts=32, top_k=4, scoring="sigmoid"),
    # dsv3's routed experts on one rank of 8-way expert parallelism
    "dsv3_ep8_local": RouterConfig(num_experts=32, top_k=1, scoring="sigmoid"),
    # softmax chosen with a correction bias (ERNIE 4.5)
    "softmax_bias": RouterConfig(num_experts=64, top_k=6, use_correction_bias=True),
    # group-limited greedy: softmax, groups scored by their best expert (DeepSeek-V2)
    "deepseek_v2": RouterConfig(
        num_experts=160,
        top_k=6,
        num_groups=8,
        top_groups=3,
        group_score="max",
        routed_scaling_factor=16.0,
        renormalize=False,
    ),
    "softmax_groups": RouterConfig(num_experts=64, top_k=4, num_groups=8, top_groups=2),
    # the choice on the logits + bias (Kolibri)
    "choice_on_logits": RouterConfig(
        num_experts=40, top_k=4, scoring="sigmoid", use_correction_bias=True, choice_on_logits=True
    ),
    # PhiMoE's sparsemixer (a wide gap, so that its softmaxes take several logits)
    "sparsemixer": RouterConfig(
        num_experts=16, top_k=2, scoring="sparsemixer", renormalize=False, sparsemixer_eps=0.3
    ),
    "sparsemixer_renormalized": RouterConfig(num_experts=40, top_k=2, scoring="sparsemixer"),
    # DeepSeek-V4's sqrt(softplus) scores, chosen with a bias
    "sqrtsoftplus_bias": RouterConfig(
        num_experts=256,
        top_k=6,
        scoring="sqrtsoftplus",
        use_correction_bias=True,
        routed_scaling_factor=1.5,
    ),
    "sigmoid_groups_by_max": RouterConfig(
        num_experts=64,
        top_k=4,
        scoring="sigmoid",
        num_groups=4,
        top_groups=2,
        group_score="max",
        use_correction_bias=True,
        dropped_group_score=0.0,
    ),
}


def _choice_scores(logits_TE: torch.Tensor, router: RouterConfig, bias_E) -> torch.Tensor:
    """What the experts are ranked by (before the group mask)."""
    logits = logits_TE.float()
    if router.scoring == "sparsemixer":  # its rounds take the largest logits left
        return logits
    scores = scores_of(logits, router.scoring)
    choice = logits if router.choice_on_logits else scores
    return choice + bias_E if router.use_correction_bias else choice


def _poison_allocator(device) -> None:
    # the next allocations reuse this memory: anything the kernels leave unwritten reads NaN
    torch.full((64 << 20,), float("nan"), dtype=torch.float32, device=device)


def _check_against_torch(
    router,
    tokens,
    hidden,
    *,
    logits_dtype=torch.float32,
    capacity=None,
    shared_experts=0,
    gather_rows=False,
    shared_gate=False,
):
    """With `shared_experts` S the batch holds E + S experts, the last S every token's with
    weight 1 (`shared_gate`: sigmoid of a random gate logit per token), after its routed pairs:
    LocalDispatcher's batch of E + S experts on those ids."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(tokens * 7 + router.num_experts)
    x_TH = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=generator)
    logits_TE = torch.randn(tokens, router.num_experts, device=device, generator=generator).to(
        logits_dtype
    )
    bias_E = (
        0.1 * torch.randn(router.num_experts, device=device, generator=generator)
        if router.use_correction_bias
        else None
    )
    gate_T = 4 * torch.randn(tokens, device=device, generator=generator) if shared_gate else None
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=hidden, capacity=capacity)
    _poison_allocator(device)
    batch, handle, pair_ids_TP = dispatcher.route_and_dispatch(
        x_TH,
        logits_TE,
        correction_bias_E=bias_E,
        shared_experts=shared_experts,
        shared_gate_logits_T=gate_T,
        gather_rows=gather_rows,
    )
    ref_ids_TK, ref_weights_TK = route(logits_TE, router, correction_bias_E=bias_E)
    top_k, experts = router.top_k, router.num_experts
    assert pair_ids_TP.shape == handle.topk_weights_TK.shape == (tokens, top_k + shared_experts)
    shared_ids = torch.arange(experts, experts + shared_experts, device=device, dtype=torch.int32)
    assert torch.equal(pair_ids_TP[:, top_k:], shared_ids.expand(tokens, shared_experts))
    if shared_gate:
        torch.testing.assert_close(
            handle.topk_weights_TK[:, top_k:],
            torch.sigmoid(gate_T)[:, None].expand(tokens, shared_experts),
            rtol=2e-6,
            atol=1e-7,
        )
    else:
        assert (handle.topk_weights_TK[:, top_k:] == 1.0).all()
    ids_TK = pair_ids_TP[:, :top_k]

    # the same choice scores are chosen in the same order (ids may swap between equal scores)
    choice_TE = _choice_scores(logits_TE, router, bias_E)
    assert torch.equal(choice_TE.gather(1, ids_TK.long()), choice_TE.gather(1, ref_ids_TK.long()))
    assert ((ids_TK >= 0) & (ids_TK < router.num_experts)).all()
    unique_ids = (ids_TK == ref_ids_TK).all(dim=1)
    torch.testing.assert_close(
        handle.topk_weights_TK[:, :top_k][unique_ids],
        ref_weights_TK[unique_ids],
        rtol=2e-6,
        atol=1e-7,
    )
    # placement and copy: exactly LocalDispatcher's on the kernel's own routing
    batch_capacity = dispatcher.batch_capacity(tokens, shared_experts=shared_experts)
    oracle, oracle_handle = LocalDispatcher(
        experts + shared_experts, capacity=batch_capacity
    ).dispatch(x_TH, pair_ids_TP, handle.topk_weights_TK)
    valid = tokens * (top_k + shared_experts)
    assert torch.equal(batch.expert_offsets, oracle.expert_offsets)
    assert torch.equal(handle.row_of_pair_TK.long(), oracle_handle.row_of_pair_TK.long())
    assert torch.equal(batch.materialized().rows_MH[:valid], oracle.rows_MH[:valid])
    assert batch.capacity == batch_capacity
    launcher = dispatcher._route_launcher(
        logits_dtype, device, torch.bfloat16, gather_rows, shared_experts, False, shared_gate
    )
    assert launcher.status(device) == [0, 0, 0, 0]

    # combine: the torch combine's bits, with and without the shared experts' addend
    expert_out_MH = torch.randn_like(batch.materialized().rows_MH)
    y_TH = dispatcher.combine(expert_out_MH, handle)
    expected_TH = weighted_sum_over_topk(
        expert_out_MH, handle.row_of_pair_TK, handle.topk_weights_TK, output_dtype=torch.bfloat16
    )
    assert torch.equal(y_TH, expected_TH)
    shared_TH = torch.randn_like(x_TH)
    assert torch.equal(
        dispatcher.combine(expert_out_MH, handle, addend_TH=shared_TH), expected_TH + shared_TH
    )
    unweighted_TH = dispatcher.combine(expert_out_MH, handle, weights_applied=True)
    assert torch.equal(
        unweighted_TH,
        weighted_sum_over_topk(
            expert_out_MH, handle.row_of_pair_TK, None, output_dtype=torch.bfloat16
        ),
    )


@pytest.mark.parametrize("name", sorted(ROUTERS))
@pytest.mark.parametrize("tokens", [0, 1, 5, 300, 4099])
def test_routing_dispatch_combine_match_torch(name, tokens):
    router = ROUTERS[name]
    _needs_kernels(router, 264)
    _check_against_torch(router, tokens, 264)


@pytest.mark.parametrize("name", sorted(ROUTERS))
@pytest.mark.parametrize("tokens", [0, 1, 300])
def test_routing_alone_matches_the_fused_launch(name, tokens):
    """route() (the expert-parallel dispatchers' input) is the fused launch's routing."""
    router = ROUTERS[name]
    _needs_kernels(router, 264)
    x_TH = torch.randn(tokens, 264, device="cuda", dtype=torch.bfloat16)
    logits_TE = torch.randn(tokens, router.num_experts, device="cuda")
    bias_E = 0.1 * torch.randn(router.num_experts, device="cuda")
    bias_E = bias_E if router.use_correction_bias else None
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=264)
    ids_TK, weights_TK = dispatcher.route(logits_TE, correction_bias_E=bias_E)
    _, handle, fused_ids_TK = dispatcher.route_and_dispatch(
        x_TH, logits_TE, correction_bias_E=bias_E
    )
    assert torch.equal(ids_TK, fused_ids_TK)
    assert torch.equal(weights_TK, handle.topk_weights_TK)


@pytest.mark.parametrize("hidden", [2048, 2880, 7168])
def test_row_widths_and_many_tokens_per_warp(hidden):
    router = ROUTERS["qwen3"]
    _needs_kernels(router, hidden)
    _check_against_torch(router, 9000, hidden)


@pytest.mark.parametrize(
    ("top_k", "hidden", "addend"),
    [(1, 7168, False), (2, 4096, False), (8, 1024, False), (9, 7168, True)],
)
def test_the_combine_strides_past_one_wave(top_k, hidden, addend):
    """Enough (token, 16-byte) items for each thread of the one-wave grid to take several (8 or
    6 CTAs per SM by top_k): the torch combine's bits, every token's row written."""
    from megamoe_kernels.shim.local_layer import combine_launcher, combine_residency

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(top_k)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    threads, ctas_per_sm = combine_residency(top_k)
    # three strides of the grid's threads over the tokens' 16-byte items, and a tail
    tokens = 3 * sms * ctas_per_sm * threads // (hidden // 8) + 5
    rows = tokens * top_k + 7
    expert_out_MH = torch.randn(
        rows, hidden, device=device, dtype=torch.bfloat16, generator=generator
    )
    row_of_pair_TK = torch.randperm(rows, device=device, generator=generator)[: tokens * top_k]
    row_of_pair_TK = row_of_pair_TK.int().view(tokens, top_k)
    weights_TK = torch.rand(tokens, top_k, device=device, generator=generator)
    addend_TH = (
        torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=generator)
        if addend
        else None
    )
    launcher = combine_launcher(
        top_k=top_k, hidden_size=hidden, has_addend=addend, dtype=torch.bfloat16, device=device
    )
    _poison_allocator(device)
    y_TH = launcher(expert_out_MH, row_of_pair_TK, weights_TK, addend_TH=addend_TH)
    expected_TH = weighted_sum_over_topk(
        expert_out_MH, row_of_pair_TK, weights_TK, output_dtype=torch.bfloat16
    )
    if addend:
        expected_TH = expected_TH + addend_TH
    assert torch.equal(y_TH, expected_TH)
    # into a given output (a captured forward's static one), poisoned first: the same bits
    out_TH = torch.full_like(expected_TH, float("nan"))
    written = launcher(
        expert_out_MH, row_of_pair_TK, weights_TK, addend_TH=addend_TH, out_TH=out_TH
    )
    assert written is out_TH
    assert torch.equal(out_TH, expected_TH)


def test_bf16_logits_with_ties():
    router = ROUTERS["qwen3"]
    _needs_kernels(router, 512)
    _check_against_torch(router, 2000, 512, logits_dtype=torch.bfloat16)


def test_capacity_tail_and_overflow():
    router = ROUTERS["dsv3"]
    _needs_kernels(router, 512)
    _check_against_torch(router, 37, 512, capacity=37 * 8 + 100)
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=512, capacity=10)
    x_TH = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    logits_TE = torch.randn(2, 256, device="cuda")
    with pytest.raises(ValueError, match="exceed the capacity"):
        dispatcher.route_and_dispatch(
            x_TH, logits_TE, correction_bias_E=torch.zeros(256, device="cuda")
        )


@pytest.mark.parametrize("name", ["dsv3", "qwen3", "mixtral"])
@pytest.mark.parametrize("shared_experts", [1, 3])
@pytest.mark.parametrize("tokens", [0, 1, 5, 300, 4099])
def test_shared_experts_in_the_batch(name, shared_experts, tokens):
    """Shared experts in the batch (one CTA and the grid; copied rows), then gathered rows and
    a capacity with its tail."""
    router = ROUTERS[name]
    _needs_kernels(router, 264)
    _check_against_torch(router, tokens, 264, shared_experts=shared_experts)
    if tokens:
        _check_against_torch(router, tokens, 512, shared_experts=shared_experts, gather_rows=True)
        _check_against_torch(
            router, tokens, 264, shared_experts=shared_experts, capacity=tokens * router.top_k + 9
        )


@pytest.mark.parametrize("tokens", [0, 1, 5, 300, 4099])
def test_gated_shared_experts_in_the_batch(tokens):
    """Qwen2-MoE's shared MLP (four routed sizes) with its sigmoid gate: the shared pairs weigh
    sigmoid(gate logit); copied and gathered rows."""
    router = ROUTERS["qwen3"]
    _needs_kernels(router, 264)
    _check_against_torch(router, tokens, 264, shared_experts=4, shared_gate=True)
    if tokens:
        _check_against_torch(
            router, tokens, 512, shared_experts=4, shared_gate=True, gather_rows=True
        )


def test_a_shared_gate_without_shared_experts_is_refused():
    router = ROUTERS["qwen3"]
    _needs_kernels(router, 264)
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=264)
    x_TH = torch.randn(3, 264, device="cuda", dtype=torch.bfloat16)
    logits_TE = torch.randn(3, router.num_experts, device="cuda")
    with pytest.raises(ValueError, match="shared_gate_logits_T gates shared experts"):
        dispatcher.route_and_dispatch(
            x_TH, logits_TE, shared_gate_logits_T=torch.zeros(3, device="cuda")
        )


def test_one_expert_takes_everything_and_empty_experts():
    router = RouterConfig(num_experts=64, top_k=1)
    _needs_kernels(router, 256)
    x_TH = torch.randn(3000, 256, device="cuda", dtype=torch.bfloat16)
    logits_TE = torch.randn(3000, 64, device="cuda")
    logits_TE[:, 17] += 100.0
    batch, handle, ids_TK = DeviceRoutedDispatcher(router, hidden_size=256).route_and_dispatch(
        x_TH, logits_TE
    )
    assert (ids_TK == 17).all()
    offsets = batch.expert_offsets.tolist()
    assert offsets[:18] == [0] * 18 and offsets[18:] == [3000] * 47
    assert torch.equal(batch.rows_MH, x_TH)
    assert torch.equal(
        handle.row_of_pair_TK[:, 0], torch.arange(3000, device="cuda", dtype=torch.int32)
    )


def test_nan_logits_stay_in_their_token():
    router = ROUTERS["dsv3"]
    _needs_kernels(router, 256)
    x_TH = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    logits_TE = torch.randn(64, 256, device="cuda")
    logits_TE[5, 3] = float("nan")
    bias_E = torch.zeros(256, device="cuda")
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=256)
    _, handle, ids_TK = dispatcher.route_and_dispatch(x_TH, logits_TE, correction_bias_E=bias_E)
    assert ((ids_TK >= 0) & (ids_TK < 256)).all()  # ids never leave the range
    assert 3 in ids_TK[5].tolist()  # NaN ranks above every number, as in torch.topk
    assert torch.isnan(handle.topk_weights_TK[5]).all()
    assert torch.isfinite(handle.topk_weights_TK[torch.arange(64, device="cuda") != 5]).all()


@pytest.mark.parametrize(
    "name",
    [
        "qwen3",
        "odd_experts",
        "dsv3",
        "deepseek_v2",
        "softmax_groups",
        "choice_on_logits",
        "sigmoid_groups_by_max",
    ],
)
def test_ties_go_to_the_lower_expert_and_nans_rank_first(name):
    """Equal choice scores are taken in expert order (with groups, the first groups are kept,
    whether a group is scored by its two best experts or its best);
    a NaN logit's expert comes before every number under sigmoid scoring (under softmax it
    makes every score of its token NaN: a tie, taken in expert order). Token 7's three largest
    tie across a lane's registers (lane l holds experts l, l + 32, ...): 9 in the first, 33 and
    38 in the second, on lanes below 9."""
    router = ROUTERS[name]
    _needs_kernels(router, 256)
    experts, top_k, tokens = router.num_experts, router.top_k, 40
    logits_TE = torch.zeros(tokens, experts, device="cuda")
    nan_experts = [3, experts - 1]
    logits_TE[2, nan_experts] = float("nan")
    tied_experts = [9, 33, 38]
    logits_TE[7, tied_experts] = 1.0
    bias_E = torch.zeros(experts, device="cuda") if router.use_correction_bias else None
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=256)
    x_TH = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    _, _, ids_TK = dispatcher.route_and_dispatch(x_TH, logits_TE, correction_bias_E=bias_E)
    ids = ids_TK.tolist()
    in_order = list(range(top_k))
    assert all(row == in_order for t, row in enumerate(ids) if t not in (2, 7))
    # the groups kept: the tied experts', then the first of the others (equal scores)
    per_group = experts // router.num_groups
    tied_groups = sorted({e // per_group for e in tied_experts})
    kept = tied_groups + [g for g in range(router.num_groups) if g not in tied_groups]
    kept = kept[: router.top_groups]
    others = [e for e in range(experts) if e not in tied_experts and e // per_group in kept]
    assert ids[7] == tied_experts + others[: top_k - len(tied_experts)]
    if router.scoring == "sigmoid":
        numbers = [e for e in range(experts) if e not in nan_experts]
        assert ids[2] == nan_experts + numbers[: top_k - 2]
    else:
        assert ids[2] == in_order


def test_a_captured_one_cta_routing_records_no_fill():
    """A graph of a decode step's routing launch (one CTA) holds that launch alone: its
    scratch and status are never zeroed, so no fill kernel joins the replay."""
    router = ROUTERS["qwen3"]
    _needs_kernels(router, 2048)
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=2048)
    x_TH = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    logits_TE = torch.randn(1, 128, device="cuda")
    eager_ids_TK = dispatcher.route_and_dispatch(x_TH, logits_TE)[2].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids_TK = dispatcher.route_and_dispatch(x_TH, logits_TE)[2]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e.key for e in profiler.key_averages() if e.device_type.name == "CUDA"]
    assert len(kernels) == 1 and "route_and_place" in kernels[0], kernels
    assert torch.equal(ids_TK, eager_ids_TK)


@pytest.mark.parametrize("name", ["qwen3", "dsv3", "mixtral"])
@pytest.mark.parametrize("gather_rows", [False, True])
@pytest.mark.parametrize("tokens", [0, 1, 5, 300, 4099])
def test_published_offsets_are_the_same_and_followed_by_their_word(
    monkeypatch, name, gather_rows, tokens
):
    # knobs.GATE_UP_POLLS_OFFSETS_MAX_TOKENS: the launch sets the word after the offsets to 1
    # once they are final; the outputs are the bits of the launch that does not publish them
    from megamoe_kernels.shim import knobs

    router = ROUTERS[name]
    hidden = 2048
    _needs_kernels(router, hidden)
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(tokens)
    x_TH = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=generator)
    logits_TE = torch.randn(tokens, router.num_experts, device=device, generator=generator)
    bias_E = torch.randn(router.num_experts, device=device) if router.use_correction_bias else None
    outputs = []
    for publish in (False, True):
        monkeypatch.setattr(knobs, "GATE_UP_POLLS_OFFSETS_MAX_TOKENS", tokens if publish else -1)
        dispatcher = DeviceRoutedDispatcher(router, hidden_size=hidden, capacity=4099 * 8)
        _poison_allocator(device)
        batch, handle, ids_TK = dispatcher.route_and_dispatch(
            x_TH, logits_TE, correction_bias_E=bias_E, gather_rows=gather_rows
        )
        assert batch.offsets_published == publish
        outputs.append((batch, handle, ids_TK))
    (waited, waited_handle, waited_ids), (published, handle, ids_TK) = outputs
    offsets = published.expert_offsets
    experts = router.num_experts
    word = offsets.as_strided((experts + 2,), (1,))[experts + 1]
    assert int(word) == 1
    assert torch.equal(offsets, waited.expert_offsets)
    assert torch.equal(ids_TK, waited_ids)
    assert torch.equal(handle.row_of_pair_TK, waited_handle.row_of_pair_TK)
    assert torch.equal(handle.topk_weights_TK, waited_handle.topk_weights_TK)
    valid = tokens * router.top_k
    rows, waited_rows = published.materialized().rows_MH, waited.materialized().rows_MH
    assert torch.equal(rows[:valid], waited_rows[:valid])


def test_bitwise_repeat_and_graph_replay_with_new_routing():
    router = ROUTERS["qwen3"]
    _needs_kernels(router, 512)
    tokens, capacity = 96, 96 * 8
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=512, capacity=capacity)
    x_TH = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    logits_TE = torch.randn(tokens, 128, device="cuda")

    def forward():
        batch, handle, _ = dispatcher.route_and_dispatch(x_TH, logits_TE)
        return dispatcher.combine(batch.rows_MH * 2, handle)

    def new_inputs():
        x_TH.copy_(torch.randn_like(x_TH))
        logits_TE.copy_(torch.randn_like(logits_TE))

    _check_repeat_and_replay(forward, new_inputs)


def _check_repeat_and_replay(forward, new_inputs) -> None:
    """forward() gives the same bits twice, and a CUDA graph of it (captured after a warm-up on
    a side stream) replays what it computes eagerly after each new_inputs()."""
    first, second = forward(), forward()
    assert torch.equal(first, second)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_TH = forward()
    for _ in range(3):
        new_inputs()
        graph.replay()
        assert torch.equal(y_TH, forward())


@pytest.mark.parametrize(
    ("router_name", "hidden", "tokens"),
    [
        ("qwen3", 2048, 0),
        ("qwen3", 2048, 1),
        ("qwen3", 2048, 9),  # 8 CTAs for 128 experts, at most 2 tokens each
        ("qwen3", 2048, 37),
        ("qwen3", 2048, 2048),
        ("dsv3_ep8_local", 7168, 4),  # one CTA, its 16 warps on the 28 slices of 4 rows
        ("dsv3_ep8_local", 7168, 16),  # 8 CTAs of 2 tokens
        ("dsv3_ep8_local", 7168, 129),  # 65 CTAs, the last of 1 token
        ("mixtral", 4096, 9),  # 3 CTAs of at most 4 tokens, though 8 experts fit one CTA
        ("dsv3", 7168, 300),
        ("odd_experts", 2880, 129),  # 22.5 groups of 128: a partial last group
        ("top_k_equals_experts", 4096, 16),
    ],
)
def test_fp8_rows_are_quantized_in_the_dispatch_as_quantizing_each_row_gives(
    router_name, hidden, tokens
):
    from megamoe_kernels import quantize_rows

    router = ROUTERS[router_name]
    _needs_kernels(router, hidden)
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(tokens + hidden)
    # rows of very different magnitudes, so every group gets its own scale
    x = torch.randn(tokens, hidden, device=device, generator=generator)
    x = x * torch.rand(tokens, 1, device=device, generator=generator).mul(40).sub(20).exp2()
    x = x.bfloat16()
    if tokens:
        # the edges of the divisions' fast path (scale_division): zeros of both signs,
        # subnormal and tiny values beside large ones, a group of zeros, one of negative zeros
        edges = [0.0, -0.0, 1e-39, -1e-39, 2.0**-126, -(2.0**-130), 2.0**-60, -3.0e38, 448.0]
        x[0, : len(edges)] = torch.tensor(edges, device=device)
    if tokens > 1:
        x[-1, :128] = 0.0
        x[-1, 128:256] = -0.0
    logits = torch.randn(tokens, router.num_experts, device=device, generator=generator)
    bias = torch.randn(router.num_experts, device=device, generator=generator) * 0.1
    bias = bias if router.use_correction_bias else None
    capacity = tokens * router.top_k + 5  # a tail of rows past the pairs
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=hidden, capacity=capacity)
    batch, handle, ids = dispatcher.route_and_dispatch(x, logits, correction_bias_E=bias)
    _poison_allocator(device)
    fp8_batch, fp8_handle, fp8_ids = dispatcher.route_and_dispatch(
        x, logits, correction_bias_E=bias, rows_dtype=torch.float8_e4m3fn
    )
    assert fp8_batch.rows_MH.dtype == torch.float8_e4m3fn and fp8_handle.output_dtype == x.dtype
    assert fp8_batch.row_scales_GM.shape == (-(-hidden // 128), capacity)
    assert torch.equal(fp8_ids, ids)
    assert torch.equal(fp8_batch.expert_offsets, batch.expert_offsets)
    assert torch.equal(fp8_handle.row_of_pair_TK, handle.row_of_pair_TK)
    assert torch.equal(fp8_handle.topk_weights_TK, handle.topk_weights_TK)
    valid = tokens * router.top_k
    expected_rows, expected_scales = quantize_rows(batch.rows_MH[:valid])
    assert torch.equal(fp8_batch.rows_MH[:valid].view(torch.uint8), expected_rows.view(torch.uint8))
    assert torch.equal(fp8_batch.row_scales_GM[:, :valid], expected_scales)
    repeat, _, _ = dispatcher.route_and_dispatch(
        x, logits, correction_bias_E=bias, rows_dtype=torch.float8_e4m3fn
    )
    assert torch.equal(repeat.rows_MH[:valid].view(torch.uint8), expected_rows.view(torch.uint8))


@pytest.mark.parametrize("hidden", [264, 2880, 7168])
@pytest.mark.parametrize("rows_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("tokens", [1, 5, 15, 40])
def test_rows_split_between_warps_give_the_bits_of_rows_copied_by_token(hidden, rows_dtype, tokens):
    """split_tokens: a CTA of fewer tokens shares its rows' copies (or quantization) between its
    warps, in slices of 32 x unroll vectors (the last one partial where the row is not whole
    slices: 264 and 2880); the batch, its scales and the routing outputs are split_tokens=0's
    bit for bit (40 tokens: a grid whose CTAs hold fewer than 16 tokens)."""
    from megamoe_kernels.shim.local_layer import RouteLauncher
    from megamoe_runtime.dispatch.device_routed import route_launcher_constants

    router = ROUTERS["qwen3"]
    _needs_kernels(router, hidden)
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(tokens * 3 + hidden)
    x = torch.randn(tokens, hidden, device=device, generator=generator).bfloat16()
    logits = torch.randn(tokens, router.num_experts, device=device, generator=generator)
    valid = tokens * router.top_k
    outputs = {}
    for split in (0, 16):
        launcher = RouteLauncher(
            **route_launcher_constants(router),
            hidden_size=hidden,
            rows_dtype=rows_dtype,
            split_tokens=split,
            one_cta_tokens=4,
            device=device,
        )
        _poison_allocator(device)
        outputs[split] = launcher(logits, x, capacity=valid + 3)
    for name, kept, split in zip(outputs[0]._fields, outputs[0], outputs[16], strict=True):
        if kept is None:
            assert split is None
            continue
        if name == "rows_MH":
            kept, split = kept[:valid].view(torch.uint8), split[:valid].view(torch.uint8)
        if name == "row_scales_GM":
            kept, split = kept[:, :valid], split[:, :valid]
        assert torch.equal(kept, split), name


# Llama 4's routing: sigmoid, top-1 (Scout's 16 experts) or top-2, not renormalised
WEIGHTS_ON_INPUT_ROUTERS = {
    "llama4_top1": RouterConfig(num_experts=16, top_k=1, scoring="sigmoid", renormalize=False),
    "llama4_top2": RouterConfig(num_experts=128, top_k=2, scoring="sigmoid", renormalize=False),
}


@pytest.mark.parametrize("name", sorted(WEIGHTS_ON_INPUT_ROUTERS))
@pytest.mark.parametrize("shared_experts", [0, 1])
@pytest.mark.parametrize("copy_by_token", [True, False])
@pytest.mark.parametrize("tokens", [0, 1, 5, 77, 600, 4099])
def test_rows_scaled_by_their_weights_are_the_bits_of_torchs_product(
    name, shared_experts, copy_by_token, tokens
):
    """weights_on_input: each batch row is x * w.to(bf16) bit for bit (the torch layer path's
    scaling of the dispatched rows), on the kernel's own routing; the rest of the launch is
    the plain one's, and the combine sums the rows unweighted."""
    from megamoe_kernels.shim.local_layer import route_launcher
    from megamoe_runtime.dispatch.device_routed import route_launcher_constants

    router = WEIGHTS_ON_INPUT_ROUTERS[name]
    hidden = 5120
    _needs_kernels(router, hidden)
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(tokens * 3 + router.top_k)
    # rows of very different magnitudes, so the products cover many exponents
    x_TH = torch.randn(tokens, hidden, device=device, generator=generator)
    x_TH = x_TH * torch.rand(tokens, 1, device=device, generator=generator).mul(40).sub(20).exp2()
    x_TH = x_TH.bfloat16()
    logits_TE = torch.randn(tokens, router.num_experts, device=device, generator=generator)
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=hidden)
    plain, plain_handle, plain_ids = dispatcher.route_and_dispatch(
        x_TH, logits_TE, shared_experts=shared_experts
    )
    _poison_allocator(device)
    if copy_by_token:
        batch, handle, ids = dispatcher.route_and_dispatch(
            x_TH, logits_TE, shared_experts=shared_experts, weights_on_input=True
        )
        rows_MH, offsets = batch.rows_MH, batch.expert_offsets
    else:  # a warp per pair: the launcher's other copy
        launcher = route_launcher(
            **route_launcher_constants(router),
            hidden_size=hidden,
            shared_experts=shared_experts,
            weights_on_input=True,
            copy_by_token=False,
            device=device,
        )
        capacity = dispatcher.batch_capacity(tokens, shared_experts=shared_experts)
        routed = launcher(logits_TE, x_TH, capacity=capacity)
        ids, offsets, rows_MH = routed.topk_ids_TK, routed.expert_offsets, routed.rows_MH
        handle = LocalHandle(
            row_of_pair_TK=routed.row_of_pair_TK,
            topk_weights_TK=routed.topk_weights_TK,
            output_dtype=x_TH.dtype,
        )
    assert torch.equal(ids, plain_ids)
    assert torch.equal(offsets, plain.expert_offsets)
    assert torch.equal(handle.row_of_pair_TK, plain_handle.row_of_pair_TK)
    assert torch.equal(handle.topk_weights_TK, plain_handle.topk_weights_TK)
    valid = tokens * (router.top_k + shared_experts)
    row_weights_M1 = row_weights_of(plain, plain_handle)[:valid].unsqueeze(-1)
    expected_MH = plain.rows_MH[:valid] * row_weights_M1.to(torch.bfloat16)
    assert torch.equal(rows_MH[:valid].view(torch.int16), expected_MH.view(torch.int16))
    expert_out_MH = torch.randn_like(rows_MH)
    assert torch.equal(
        dispatcher.combine(expert_out_MH, handle, weights_applied=True),
        weighted_sum_over_topk(
            expert_out_MH, handle.row_of_pair_TK, None, output_dtype=torch.bfloat16
        ),
    )


def test_scaled_rows_are_refused_with_fp8_or_gathered_rows():
    router = WEIGHTS_ON_INPUT_ROUTERS["llama4_top1"]
    _needs_kernels(router, 256)
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=256)
    x_TH = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    logits_TE = torch.randn(4, 16, device="cuda")
    for refused in (dict(gather_rows=True), dict(rows_dtype=torch.float8_e4m3fn)):
        with pytest.raises(ValueError, match="weights_on_input=True"):
            dispatcher.route_and_dispatch(x_TH, logits_TE, weights_on_input=True, **refused)


def _given_ids(tokens, router, generator, *, repeats=False, dtype=torch.int64):
    """[T, K] ids: distinct per token (a top-k's), or drawn with repeats (a table may repeat)."""
    experts, top_k = router.num_experts, router.top_k
    if repeats:
        ids = torch.randint(0, experts, (tokens, top_k), device="cuda", generator=generator)
    else:
        ids = torch.rand(tokens, experts, device="cuda", generator=generator).argsort(dim=1)
        ids = ids[:, :top_k]
    return ids.to(dtype).contiguous()


def _check_given(
    router,
    tokens,
    hidden,
    *,
    ids_dtype=torch.int64,
    weights_dtype=torch.float32,
    scored=False,
    repeats=False,
    gather_rows=False,
    shared_experts=0,
    ids_TK=None,
):
    """Places given ids (weights given, or `scored` from random logits) and checks the batch,
    offsets, pair rows and combine against LocalDispatcher on the ids (an id outside [0, E) as
    expert 0 of weight 0)."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(tokens * 11 + router.num_experts)
    x_TH = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=generator)
    if ids_TK is None:
        ids_TK = _given_ids(tokens, router, generator, repeats=repeats, dtype=ids_dtype)
    logits_TE = weights_TK = None
    if scored:
        logits_TE = 3 * torch.randn(tokens, router.num_experts, device=device, generator=generator)
    else:
        weights_TK = torch.rand(ids_TK.shape, device=device, generator=generator)
        weights_TK = weights_TK.to(weights_dtype)
    bias_E = torch.randn(router.num_experts, device=device) if router.use_correction_bias else None
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=hidden)
    _poison_allocator(device)
    batch, handle, pair_ids_TP = dispatcher.route_and_dispatch(
        x_TH,
        logits_TE,
        topk_ids_TK=ids_TK,
        topk_weights_TK=weights_TK,
        correction_bias_E=bias_E,
        gather_rows=gather_rows,
        shared_experts=shared_experts,
    )
    top_k, experts = router.top_k, router.num_experts
    valid_TK = (ids_TK >= 0) & (ids_TK < experts)
    placed_TK = torch.where(valid_TK, ids_TK, 0).to(torch.int32)
    if scored and valid_TK.all():
        expected_TK = weights_of_chosen(logits_TE, placed_TK, router)
    elif scored:  # weights_of_chosen's, the ids outside the experts left out
        expected_TK = torch.where(
            valid_TK, scores_of(logits_TE, router.scoring).gather(1, placed_TK.long()), 0.0
        )
        if router.renormalize:
            epsilon = 1e-20 if router.scoring != "softmax" else 0.0
            expected_TK = expected_TK / (expected_TK.sum(dim=-1, keepdim=True) + epsilon)
        expected_TK = expected_TK * router.routed_scaling_factor
    else:
        expected_TK = torch.where(valid_TK, weights_TK.float(), 0.0)
    assert torch.equal(pair_ids_TP[:, :top_k], placed_TK)
    if tokens:
        torch.testing.assert_close(
            handle.topk_weights_TK[:, :top_k], expected_TK, rtol=2e-6, atol=1e-7
        )
    if not scored:  # as given, to the bit
        assert torch.equal(handle.topk_weights_TK[:, :top_k], expected_TK)
    # placement and copy: exactly LocalDispatcher's on the same ids
    oracle, oracle_handle = LocalDispatcher(
        experts + shared_experts, capacity=tokens * (top_k + shared_experts)
    ).dispatch(x_TH, pair_ids_TP, handle.topk_weights_TK)
    valid = tokens * (top_k + shared_experts)
    assert torch.equal(batch.expert_offsets, oracle.expert_offsets)
    assert torch.equal(handle.row_of_pair_TK.long(), oracle_handle.row_of_pair_TK.long())
    assert torch.equal(batch.materialized().rows_MH[:valid], oracle.rows_MH[:valid])
    # the combine: the torch combine's bits
    expert_out_MH = torch.randn_like(batch.materialized().rows_MH)
    assert torch.equal(
        dispatcher.combine(expert_out_MH, handle),
        weighted_sum_over_topk(
            expert_out_MH,
            handle.row_of_pair_TK,
            handle.topk_weights_TK,
            output_dtype=torch.bfloat16,
        ),
    )


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "odd_experts", "dsv3_ep8_local"])
@pytest.mark.parametrize("tokens", [0, 1, 5, 300, 4099])
@pytest.mark.parametrize(
    ("ids_dtype", "weights_dtype"),
    [(torch.int64, torch.float32), (torch.int32, torch.bfloat16)],
    ids=["int64-f32", "int32-bf16"],
)
def test_given_experts_and_weights_are_placed_as_the_torch_path_places_them(
    name, tokens, ids_dtype, weights_dtype
):
    router = ROUTERS[name]
    _needs_kernels(router, 264)
    _check_given(router, tokens, 264, ids_dtype=ids_dtype, weights_dtype=weights_dtype)
    if tokens:
        _check_given(router, tokens, 512, gather_rows=True)
        _check_given(router, tokens, 264, repeats=True)


@pytest.mark.parametrize("name", ["sqrtsoftplus_bias", "dsv3", "qwen3"])
@pytest.mark.parametrize("shared_experts", [0, 1])
@pytest.mark.parametrize("tokens", [1, 5, 300, 4099])
def test_given_experts_weighted_by_their_scores_match_weights_of_chosen(
    name, shared_experts, tokens
):
    """DeepSeek-V4's hash layers: a table's experts (with repeats too), weighted by their
    scores from the logits; the bias and the groups play no part."""
    router = ROUTERS[name]
    _needs_kernels(router, 512)
    _check_given(router, tokens, 512, scored=True, shared_experts=shared_experts)
    _check_given(router, tokens, 512, scored=True, repeats=True, shared_experts=shared_experts)


@pytest.mark.parametrize("scored", [False, True])
def test_ids_outside_the_experts_are_placed_as_expert_0_with_weight_0(scored):
    router = ROUTERS["sqrtsoftplus_bias"] if scored else ROUTERS["qwen3"]
    _needs_kernels(router, 256)
    tokens = 600
    ids_TK = _given_ids(tokens, router, torch.Generator(device="cuda").manual_seed(3))
    ids_TK[::7, 0] = -1
    ids_TK[3::11, -1] = router.num_experts
    ids_TK[5::13, 1] = 1 << 40  # past int32
    _check_given(router, tokens, 256, scored=scored, ids_TK=ids_TK)


def test_one_expert_given_every_pair():
    """Every pair of every token names expert 3: K pairs of each token in one expert, in
    (token, k) order; every other expert empty."""
    router = ROUTERS["qwen3"]
    _needs_kernels(router, 256)
    ids_TK = torch.full((3000, 8), 3, dtype=torch.int64, device="cuda")
    _check_given(router, 3000, 256, ids_TK=ids_TK)


def test_given_weights_take_no_logits_and_need_ids():
    router = ROUTERS["qwen3"]
    _needs_kernels(router, 256)
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=256)
    x_TH = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    ids_TK = torch.zeros(3, 8, dtype=torch.int64, device="cuda")
    weights_TK = torch.ones(3, 8, device="cuda")
    logits_TE = torch.randn(3, 128, device="cuda")
    with pytest.raises(ValueError, match="router_logits_TE is None exactly where"):
        dispatcher.route_and_dispatch(
            x_TH, logits_TE, topk_ids_TK=ids_TK, topk_weights_TK=weights_TK
        )
    with pytest.raises(ValueError, match="topk_weights_TK weighs given experts"):
        dispatcher.route_and_dispatch(x_TH, None, topk_weights_TK=weights_TK)
    with pytest.raises(ValueError, match="given_ids_dtype=torch.float32 is not None"):
        dispatcher.route_and_dispatch(
            x_TH, None, topk_ids_TK=ids_TK.float(), topk_weights_TK=weights_TK
        )


def test_given_experts_replay_in_a_graph_with_new_ids():
    router = ROUTERS["qwen3"]
    _needs_kernels(router, 512)
    tokens = 96
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=512, capacity=tokens * 8)
    generator = torch.Generator(device="cuda").manual_seed(0)
    x_TH = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    ids_TK = _given_ids(tokens, router, generator)
    weights_TK = torch.rand(tokens, 8, device="cuda")

    def forward():
        batch, handle, _ = dispatcher.route_and_dispatch(
            x_TH, None, topk_ids_TK=ids_TK, topk_weights_TK=weights_TK
        )
        return dispatcher.combine(batch.rows_MH * 2, handle)

    def new_inputs():
        x_TH.copy_(torch.randn_like(x_TH))
        ids_TK.copy_(_given_ids(tokens, router, generator))
        weights_TK.copy_(torch.rand_like(weights_TK))

    _check_repeat_and_replay(forward, new_inputs)


@pytest.mark.parametrize(
    ("name", "shared_experts", "rows"),
    [
        ("qwen3", 0, "bf16"),
        ("qwen3", 0, "gathered"),
        ("qwen3", 0, "fp8"),
        ("dsv3", 1, "bf16"),
        ("mixtral", 0, "bf16"),
    ],
)
@pytest.mark.parametrize(
    ("bucket", "count"),
    [
        (16, 0),
        (16, 1),
        (16, 9),
        (512, 1),
        (512, 257),
        (512, 511),
        (512, 512),
        (512, 900),
        (4096, 2049),
    ],
)
def test_a_token_count_routes_places_and_combines_the_first_tokens_alone(
    name, shared_experts, rows, bucket, count
):
    """A bucket of `bucket` token rows whose device word says `count` (a graph of a bucket of
    token counts): the ids, weights, pair rows, offsets, batch rows (or row sources) and
    scales of the first min(count, bucket) tokens are those of a launch of those tokens alone,
    bit for bit, whatever the rows past them hold (NaN logits and tokens here); the combine
    writes those tokens' rows alone, the bits of the combine of the tokens alone, and leaves
    the rest of its output as it was."""
    router = ROUTERS[name]
    hidden = 512
    _needs_kernels(router, hidden)
    device = torch.device("cuda")
    taken = min(count, bucket)
    generator = torch.Generator(device=device).manual_seed(bucket + 3 * count)
    x_TH = torch.randn(bucket, hidden, device=device, generator=generator).bfloat16()
    logits_TE = torch.randn(bucket, router.num_experts, device=device, generator=generator)
    x_TH[taken:] = float("nan")  # stale rows: never read
    logits_TE[taken:] = float("nan")
    bias_E = (
        0.1 * torch.randn(router.num_experts, device=device, generator=generator)
        if router.use_correction_bias
        else None
    )
    token_count = torch.tensor([count], dtype=torch.int32, device=device)
    options = dict(
        correction_bias_E=bias_E,
        shared_experts=shared_experts,
        gather_rows=rows == "gathered",
        rows_dtype=torch.float8_e4m3fn if rows == "fp8" else None,
    )
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=hidden)
    _poison_allocator(device)
    batch, handle, ids_TP = dispatcher.route_and_dispatch(
        x_TH, logits_TE, token_count=token_count, **options
    )
    ref_batch, ref_handle, ref_ids_TP = dispatcher.route_and_dispatch(
        x_TH[:taken].clone(), logits_TE[:taken].clone(), **options
    )
    valid = taken * (router.top_k + shared_experts)
    assert torch.equal(ids_TP[:taken], ref_ids_TP)
    assert torch.equal(handle.topk_weights_TK[:taken], ref_handle.topk_weights_TK)
    assert torch.equal(handle.row_of_pair_TK[:taken], ref_handle.row_of_pair_TK)
    assert torch.equal(batch.expert_offsets, ref_batch.expert_offsets)
    if rows == "gathered":
        assert torch.equal(batch.row_source_M[:valid], ref_batch.row_source_M[:valid])
    else:
        assert torch.equal(
            batch.rows_MH[:valid].view(torch.uint8), ref_batch.rows_MH[:valid].view(torch.uint8)
        )
    if rows == "fp8":
        assert torch.equal(batch.row_scales_GM[:, :valid], ref_batch.row_scales_GM[:, :valid])
    expert_out_MH = torch.randn(
        batch.capacity, hidden, device=device, generator=generator
    ).bfloat16()
    poison = torch.full((bucket, hidden), float("nan"), device=device, dtype=torch.bfloat16)
    addend_TH = torch.randn(bucket, hidden, device=device, generator=generator).bfloat16()
    for addend in (None, addend_TH):
        y_TH = dispatcher.combine(expert_out_MH, handle, addend_TH=addend, out_TH=poison.clone())
        expected_TH = dispatcher.combine(
            expert_out_MH, ref_handle, addend_TH=None if addend is None else addend[:taken]
        )
        assert torch.equal(y_TH[:taken], expected_TH)
        assert y_TH[taken:].isnan().all()  # rows past the count: as they were
    launcher = dispatcher._route_launcher(
        torch.float32,
        device,
        options["rows_dtype"] or torch.bfloat16,
        options["gather_rows"],
        shared_experts,
    )
    assert launcher.status(device) == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="row weights of a routing with a token_count"):
        row_weights_of(batch, handle)


@pytest.mark.parametrize("name", ["qwen3", "dsv3", "mixtral"])
@pytest.mark.parametrize("gather_rows", [False, True])
@pytest.mark.parametrize("shared_experts", [0, 1])
@pytest.mark.parametrize("tokens", [0, 1, 5, 300, 4099])
def test_row_tokens_for_the_atomic_combine(name, gather_rows, shared_experts, tokens):
    """reduce_into_TH: the launch zeroes the output's rows and writes each valid batch row's
    token and its pair's weight, the rest of the routing unchanged."""
    router = ROUTERS[name]
    _needs_kernels(router, 512)
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    x_TH = torch.randn(tokens, 512, device="cuda", generator=generator).bfloat16()
    logits = torch.randn(tokens, router.num_experts, device="cuda", generator=generator)
    bias = torch.randn(router.num_experts, device="cuda", generator=generator) * 0.01
    dispatcher = DeviceRoutedDispatcher(router, hidden_size=512)
    routed = dict(correction_bias_E=bias, gather_rows=gather_rows, shared_experts=shared_experts)
    plain, plain_handle, plain_ids = dispatcher.route_and_dispatch(x_TH, logits, **routed)
    out_TH = torch.full_like(x_TH, float("nan"))
    batch, handle, ids = dispatcher.route_and_dispatch(
        x_TH, logits, reduce_into_TH=out_TH, **routed
    )
    assert torch.equal(ids, plain_ids)
    assert torch.equal(handle.row_of_pair_TK, plain_handle.row_of_pair_TK)
    assert torch.equal(handle.topk_weights_TK, plain_handle.topk_weights_TK)
    assert torch.equal(batch.expert_offsets, plain.expert_offsets)
    if gather_rows:
        assert handle.row_tokens_M is batch.row_source_M
    else:
        assert torch.equal(batch.rows_MH, plain.rows_MH)
    assert plain_handle.row_tokens_M is None and plain_handle.row_weights_M is None
    rows = handle.row_of_pair_TK.long()
    pairs = rows.shape[1]
    tokens_of_pairs = torch.arange(tokens, device="cuda").unsqueeze(1).expand(tokens, pairs)
    assert torch.equal(handle.row_tokens_M[rows].long(), tokens_of_pairs)
    assert torch.equal(handle.row_weights_M[rows], handle.topk_weights_TK)
    assert torch.equal(out_TH, torch.zeros_like(out_TH))
