"""The fused single-GPU layer path (device routing, dispatch and combine) against the torch path
of the same layer, for every routing family, shared experts (gated too) included: the same
router logits, outputs within an ulp or two of the routing weights (the device softmax sums in
a warp tree, torch in its own order; ties between equal scores may pick other experts, so the
bf16-logit family is held to the fp32 oracle's tolerance only); and the fp32 oracle's
tolerance everywhere; bitwise repeatable."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from megamoe_kernels.reference import relative_l2_error
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.routing import route
from megamoe_torch.cli import fp32_oracle_of
from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.layer import MegaMoE

pytestmark = pytest.mark.gpu

FAMILIES = {
    "qwen3": dict(num_experts=32, top_k=4),
    "mixtral_input_router": dict(num_experts=8, top_k=2, router_dtype="input"),
    "qwen2_gated_shared": dict(
        num_experts=16, top_k=4, num_shared_experts=1, shared_expert_gate=True
    ),
    "dsv3": dict(
        num_experts=64,
        top_k=6,
        scoring="sigmoid",
        num_groups=8,
        top_groups=3,
        routed_scaling_factor=2.5,
        use_correction_bias=True,
        num_shared_experts=1,
    ),
    # softmax chosen with a correction bias (ERNIE 4.5)
    "ernie_softmax_bias": dict(num_experts=16, top_k=4, use_correction_bias=True),
    # group-limited greedy, groups scored by their best expert (DeepSeek-V2)
    "deepseek_v2": dict(
        num_experts=32,
        top_k=6,
        num_groups=8,
        top_groups=3,
        group_score="max",
        routed_scaling_factor=16.0,
        renormalize=False,
        num_shared_experts=2,
    ),
    # PhiMoE's sparsemixer
    "phimoe_sparsemixer": dict(
        num_experts=16, top_k=2, scoring="sparsemixer", renormalize=False, sparsemixer_eps=0.3
    ),
    # sqrt(softplus) scores chosen with a bias, a shared expert, SwiGLU clamped (DeepSeek-V4)
    "deepseek_v4": dict(
        num_experts=32,
        top_k=6,
        scoring="sqrtsoftplus",
        use_correction_bias=True,
        routed_scaling_factor=1.5,
        num_shared_experts=1,
        swiglu_limit=10.0,
        shared_swiglu="routed",
    ),
    # the choice on the logits + bias (Kolibri)
    "kolibri_choice_on_logits": dict(
        num_experts=16,
        top_k=4,
        scoring="sigmoid",
        use_correction_bias=True,
        choice_on_logits=True,
    ),
}


def _pair(family: str, backend: str, tokens: int, **overrides) -> tuple[MegaMoE, MegaMoE]:
    fields = dict(hidden_size=512, intermediate_size=256, backend=backend, **FAMILIES[family])
    fields.update(overrides)
    torch.manual_seed(0)
    fused = MegaMoE(
        MegaMoEConfig(**fields, layer_path="fused"), device="cuda", dtype=torch.bfloat16
    )
    if fused.e_score_correction_bias is not None:
        fused.e_score_correction_bias.normal_(0, 0.05)
    plain = MegaMoE(
        MegaMoEConfig(**fields, layer_path="torch"), device="cuda", dtype=torch.bfloat16
    )
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def check_a_callers_capture(
    layer: MegaMoE, x: torch.Tensor, *, expected: MegaMoE, matches=torch.equal, replays: int = 1
) -> None:
    """`layer` captured in a caller's CUDA graph (after a warm-up on a side stream) replays new
    tokens in x, `replays` times, each output `matches` what `expected` computes eagerly (by
    default its bits)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    for _ in range(replays):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert matches(y, expected(x))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("backend", ["cutedsl", "reference"])
# 33 tokens: the router-logits kernel's logits over five blocks of 8 tokens
@pytest.mark.parametrize("tokens", [0, 1, 33, 77, 1500])
@torch.no_grad()
def test_fused_path_matches_torch_path(family, backend, tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        # the shared experts as their own MLP on both paths (test_shared_experts_in_the_batch
        # covers them as experts of the batch)
        fused, plain = _pair(family, backend, tokens, shared_experts_path="side_stream")
        ok, why = fused.fused_path_status()
    except ValueError as refused:
        pytest.skip(str(refused))
    if not ok or fused.backend != backend:
        pytest.skip(why)
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    y, logits = fused(x, return_router_logits=True)
    expected, expected_logits = plain(x, return_router_logits=True)
    assert torch.equal(logits, expected_logits)
    assert torch.equal(fused(x), y)  # deterministic
    if not tokens:
        return
    if logits.dtype != torch.float32:
        # bf16 logits tie often: a tie broken the other way picks another expert for that token
        assert relative_l2_error(y.float(), expected.float()) < 2e-2
        return  # and bf16 routing flips against the fp32 oracle's (4% at 8 experts, top-2)
    assert relative_l2_error(y.float(), expected.float()) < 2e-3
    oracle = fp32_oracle_of(fused)
    assert relative_l2_error(y.float(), oracle(x.float())) < 2e-2


@torch.no_grad()
def test_autograd_takes_the_torch_path():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fused, _ = _pair("qwen3", "reference", 8)
    if not fused.fused_path_status()[0]:
        pytest.skip(fused.fused_path_status()[1])
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    with torch.enable_grad():
        y = fused(x)
        assert y.requires_grad


@pytest.mark.parametrize("family", ["dsv3", "qwen2_gated_shared"])
@pytest.mark.parametrize("tokens", [1, 77, 1500])
@torch.no_grad()
def test_shared_experts_on_a_side_stream_give_the_same_bits(family, tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    beside, _ = _pair(family, "cutedsl", tokens, shared_experts_path="side_stream")
    ok, why = beside.fused_path_status()
    if not ok or beside.backend != "cutedsl":
        pytest.skip(why)
    fused = MegaMoE(  # the same layer, its shared experts on the caller's stream
        replace(beside.config, shared_experts_path="caller_stream"),
        device="meta",
        dtype=torch.bfloat16,
    )
    fused.load_state_dict(beside.state_dict(), assign=True)
    for seed in range(3):  # launched, then (up to 128 tokens) captured and replayed
        generator = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, 512, device="cuda", generator=generator).bfloat16()
        assert torch.equal(beside(x), fused(x))
    # inside a caller's capture the fork and the join are recorded too
    check_a_callers_capture(beside, x, expected=fused)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tokens", [0, 1, 77, 1500])
@torch.no_grad()
def test_gathered_rows_give_the_bits_of_copied_rows(family, tokens):
    """`gather_rows`: the gate-up GEMM reads each batch row from its token instead of the
    dispatch copying it out; launched, replayed from the layer's graphs and captured by a
    caller."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gathering, _ = _pair(family, "cutedsl", tokens)
    ok, why = gathering.fused_path_status()
    if not ok or gathering.backend != "cutedsl":
        pytest.skip(why)
    layers = {}
    for gather in (True, False):
        layer = layers[gather] = MegaMoE(
            replace(gathering.config, gather_rows=gather), device="meta", dtype=torch.bfloat16
        )
        layer.load_state_dict(gathering.state_dict(), assign=True)
    for seed in range(3):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, 512, device="cuda", generator=generator).bfloat16()
        assert torch.equal(layers[True](x), layers[False](x))
    if not tokens:
        return
    assert layers[True]._gathers_rows(x) and not layers[False]._gathers_rows(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layers[True](x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(y, layers[False](x))


# shared experts that join the batch: dsv3's one (S = 1), two of the routed size (S = 2), and
# Qwen2-MoE's gated MLP of two routed sizes (its pairs weigh sigmoid(x . w_gate))
BATCH_SHARED = {
    "dsv3": FAMILIES["dsv3"],
    "two_shared": dict(num_experts=32, top_k=4, num_shared_experts=2),
    "qwen2_gated_shared": dict(
        num_experts=16,
        top_k=4,
        renormalize=False,
        num_shared_experts=1,
        shared_intermediate_size=512,
        shared_expert_gate=True,
    ),
}


@pytest.mark.parametrize("family", sorted(BATCH_SHARED))
@pytest.mark.parametrize("backend", ["cutedsl", "reference"])
@pytest.mark.parametrize("tokens", [0, 1, 33, 77, 1500])  # 33: the gate's logits by the kernel
@torch.no_grad()
def test_shared_experts_in_the_batch(family, backend, tokens):
    """shared_experts_path="batch": the shared MLP as S experts of the routed batch (weight 1 or
    its gate's sigmoid, every token's row) gives the side stream's output within bf16 rounding
    (a gate's within bf16 rounding of its logit and sigmoid), no further from
    the fp32 oracle; bitwise repeatable, launched and replayed; a caller's capture replays
    new tokens; the routed experts alone (the torch path) run on a view of the same prepared
    weights, with their bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fields = dict(hidden_size=512, intermediate_size=256, backend=backend, **BATCH_SHARED[family])
    torch.manual_seed(0)
    beside = MegaMoE(
        MegaMoEConfig(**fields, shared_experts_path="side_stream"),
        device="cuda",
        dtype=torch.bfloat16,
    )
    if beside.e_score_correction_bias is not None:
        beside.e_score_correction_bias.normal_(0, 0.05)
    ok, why = beside.fused_path_status()
    if not ok or beside.backend != backend:
        pytest.skip(why)
    in_batch = MegaMoE(
        replace(beside.config, shared_experts_path="batch"), device="meta", dtype=torch.bfloat16
    )
    in_batch.load_state_dict(beside.state_dict(), assign=True)
    shared = in_batch._shared_experts_in_batch(tokens)
    assert shared == beside.config.shared_size // beside.config.intermediate_size
    oracle = fp32_oracle_of(beside)
    for seed in range(3):  # launched, then (up to 128 tokens) captured and replayed
        generator = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, 512, device="cuda", generator=generator).bfloat16()
        y = in_batch(x)
        assert torch.equal(in_batch(x), y)
        if not tokens:
            assert y.shape == (0, 512)
            continue
        assert torch.isfinite(y).all()
        # the side stream's shared MLP rounds gate, up, silu and their product to bf16 (torch
        # ops), the batch's SwiGLU epilogue once: no further from the fp32 oracle
        y_side = beside(x)
        expected = oracle(x.float())
        assert relative_l2_error(y.float(), y_side.float()) < 1e-2
        error, side_error = (relative_l2_error(v.float(), expected) for v in (y, y_side))
        assert error < 1.1 * side_error
    if not tokens:
        return
    # a batch of the routed experts alone (the torch path's: autograd's, torch.compile's) runs
    # on a view of the weights prepared with the shared experts: the routed weights' bits
    ids, weights = route(
        beside.router_logits(x),
        beside.config.router,
        correction_bias_E=beside.e_score_correction_bias,
    )
    routed_batch, _ = LocalDispatcher(beside.config.num_experts).dispatch(x, ids, weights)
    assert torch.equal(
        in_batch._run_expert_backend(routed_batch), beside._run_expert_backend(routed_batch)
    )
    routed, joined = (in_batch._prepared_weights(shared_in_batch=s) for s in (False, True))
    assert routed.w2_EHI.shape[0] == joined.w2_EHI.shape[0] - shared
    assert routed.w2_EHI.data_ptr() == joined.w2_EHI.data_ptr()  # a view, no copy
    # the layer's routed weights are views of the prepared ones: held once (w13 too where the
    # backend keeps the model's layout: the cutedsl kernels read it for I a multiple of 128)
    assert in_batch.w2.data_ptr() == joined.w2_EHI.data_ptr()
    joined_w13 = joined.w13 if backend == "cutedsl" else joined.w13_E2IH
    assert in_batch.w13.data_ptr() == joined_w13.data_ptr()
    if not in_batch._expert_backend.captures_in_graphs:
        return  # the reference backend reads the expert offsets on the host
    check_a_callers_capture(in_batch, x, expected=in_batch)


@pytest.mark.parametrize("family", ["qwen3", "mixtral_input_router", "dsv3"])
@pytest.mark.parametrize(
    ("backend", "weight_dtype"), [("cutedsl", None), ("reference", None), ("cutedsl", "fp8")]
)
@pytest.mark.parametrize("tokens", [0, 1, 77, 1500])
@torch.no_grad()
def test_routed_experts_of_given_experts_give_the_torch_paths_bits(
    family, backend, weight_dtype, tokens
):
    """MegaMoE.routed_experts (transformers' experts interface): the fused path places the
    given experts and weights (int64 ids, bf16 weights, as transformers hands them) where the
    torch path's dispatcher does, for the same bits (FP8 experts: the rows quantized in the
    dispatch, as the FP8 backend quantizes copied rows); with a norm of the expert rows too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fused, plain = _pair(family, backend, tokens, weight_dtype=weight_dtype)
    ok, why = fused.fused_path_status()
    if not ok or fused.backend != backend:
        pytest.skip(why)
    config = fused.config
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(tokens, config.num_experts, device="cuda").argsort(dim=1)
    ids = ids[:, : config.top_k].contiguous()
    weights = torch.rand(tokens, config.top_k, device="cuda").to(torch.bfloat16)
    y = fused.routed_experts(x, ids, weights)
    assert torch.equal(y, plain.routed_experts(x, ids, weights))
    assert torch.equal(fused.routed_experts(x, ids, weights), y)  # deterministic
    norm = torch.nn.RMSNorm(512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(
        fused.routed_experts(x, ids, weights, expert_rows_fn=norm),
        plain.routed_experts(x, ids, weights, expert_rows_fn=norm),
    )


@pytest.mark.parametrize("backend", ["cutedsl", "reference"])
@pytest.mark.parametrize("tokens", [0, 1, 77, 1500])
@torch.no_grad()
def test_a_layer_routing_by_token_id_places_its_tables_experts(backend, tokens):
    """DeepSeek-V4's hash layers on the fused path: the routing table's experts of each token
    id placed by the routing kernel, weighted by their scores there (within an ulp or two of
    the torch path's weights), the shared expert in the batch or on its own."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    vocab = 50
    hashed = dict(use_correction_bias=False, routing_table_vocab_size=vocab)
    for shared_path in ("side_stream", "auto"):
        fused, plain = _pair(
            "deepseek_v4", backend, tokens, shared_experts_path=shared_path, **hashed
        )
        ok, why = fused.fused_path_status()
        if not ok or fused.backend != backend:
            pytest.skip(why)
        x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
        input_ids = torch.randint(vocab, (tokens,), device="cuda")
        y, logits = fused(x, input_ids=input_ids, return_router_logits=True)
        expected, expected_logits = plain(x, input_ids=input_ids, return_router_logits=True)
        assert torch.equal(logits, expected_logits)
        assert torch.equal(fused(x, input_ids=input_ids), y)  # deterministic
        if tokens:
            assert relative_l2_error(y.float(), expected.float()) < 2e-3
