"""The expert math of the families the Hugging Face reader adds, against per-token float64 loops:
router and expert biases, the clamped SwiGLU of gpt-oss, routing weights on the expert input
(Llama 4), softmax with a correction bias (ERNIE 4.5), the choice on logits + bias (Kolibri),
group-limited greedy top-k (DeepSeek-V2), the sparsemixer (PhiMoE), shared experts with the routed
experts' clamped SwiGLU (MiniMax-M3), ungated relu^2 experts (Nemotron-H), and random layers of all
of them; the gpt-oss and Llama 4 layers on grouped_mm against the reference backend, forward and
backward; and what cannot compute them refused with the reason."""

import math
import random

import pytest
import torch
from megamoe_kernels import GEGLU
from megamoe_kernels.reference import relative_l2_error
from megamoe_runtime.routing import route
from megamoe_torch import MegaMoE, MegaMoEConfig

GPT_OSS = dict(
    hidden_size=32,
    intermediate_size=24,
    num_experts=8,
    top_k=3,
    router_bias=True,
    expert_bias=True,
    swiglu_limit=7.0,
    swiglu_alpha=1.702,
    swiglu_up_offset=1.0,
)
LLAMA4 = dict(
    hidden_size=32,
    intermediate_size=24,
    num_experts=8,
    top_k=2,
    scoring="sigmoid",
    renormalize=False,
    routing_weights_on_input=True,
    num_shared_experts=1,
)
ERNIE = dict(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2, use_correction_bias=True)
KOLIBRI = dict(
    hidden_size=32,
    intermediate_size=16,
    num_experts=8,
    top_k=2,
    scoring="sigmoid",
    use_correction_bias=True,
    choice_on_logits=True,
)
DEEPSEEK_V2 = dict(
    hidden_size=32,
    intermediate_size=16,
    num_experts=8,
    top_k=2,
    renormalize=False,
    num_groups=4,
    top_groups=2,
    group_score="max",
    routed_scaling_factor=1.5,
)
# a wide gap (0.3) so that the rounds' softmaxes take several logits
PHIMOE = dict(
    hidden_size=32,
    intermediate_size=16,
    num_experts=8,
    top_k=2,
    scoring="sparsemixer",
    renormalize=False,
    sparsemixer_eps=0.3,
)

MINIMAX_M3 = dict(
    hidden_size=32,
    intermediate_size=16,
    num_experts=8,
    top_k=2,
    scoring="sigmoid",
    use_correction_bias=True,
    routed_scaling_factor=2.0,
    swiglu_limit=7.0,
    swiglu_alpha=1.702,
    swiglu_up_offset=1.0,
    num_shared_experts=1,
    shared_intermediate_size=24,
    shared_swiglu="routed",
)

NEMOTRON_H = dict(
    hidden_size=32,
    intermediate_size=16,
    num_experts=8,
    top_k=2,
    scoring="sigmoid",
    use_correction_bias=True,
    num_groups=2,
    top_groups=1,
    routed_scaling_factor=2.5,
    activation="relu2",
    num_shared_experts=1,
    shared_intermediate_size=24,
)
# Inkling2's softcapped SwiGLU, its caps small enough that this layer's values pass them
INKLING2 = dict(
    hidden_size=32,
    intermediate_size=16,
    num_experts=8,
    top_k=2,
    scoring="sigmoid",
    use_correction_bias=True,
    routed_scaling_factor=8.0,
    swiglu_gate_softcap=0.5,
    swiglu_up_softcap=1.0,
)
# A.X-K1: DeepSeek-V3's routing and shared expert, the output RMSNorm-ed
AXK1 = dict(
    hidden_size=32,
    intermediate_size=16,
    num_experts=8,
    top_k=2,
    scoring="sigmoid",
    use_correction_bias=True,
    num_groups=4,
    top_groups=2,
    routed_scaling_factor=2.5,
    num_shared_experts=1,
    output_norm_eps=1e-6,
)
# DeepSeek-V4: sqrt(softplus) scores chosen with a bias, experts and shared expert clamped
DEEPSEEK_V4 = dict(
    hidden_size=32,
    intermediate_size=16,
    num_experts=8,
    top_k=3,
    scoring="sqrtsoftplus",
    use_correction_bias=True,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    num_shared_experts=1,
    shared_swiglu="routed",
)
# Gemma 4's experts: GeGLU, the tanh GELU of the gate times up
GEMMA4 = dict(
    hidden_size=32,
    intermediate_size=16,
    num_experts=8,
    top_k=2,
    swiglu_alpha=GEGLU.alpha,
    swiglu_gate_cubic=GEGLU.gate_cubic,
)
# DeepSeek-V4's hash layers: each token's experts the row of its id in a routing table
DEEPSEEK_V4_HASH = dict(DEEPSEEK_V4, use_correction_bias=False, routing_table_vocab_size=50)
# Nemotron-H's latent MoE: the routed experts on 24-wide projections of the 32-wide tokens
NEMOTRON_H_LATENT = dict(NEMOTRON_H, latent_size=24)
# LongCat-Flash: 4 identity experts scored beside the 8 routed ones
LONGCAT = dict(
    hidden_size=32,
    intermediate_size=16,
    num_experts=8,
    num_identity_experts=4,
    top_k=3,
    renormalize=False,
    use_correction_bias=True,
    routed_scaling_factor=2.0,
)


def sparsemixer_float64(logits: torch.Tensor, eps: float) -> tuple[list[int], torch.Tensor]:
    """PhiMoE's inference routing of one token, element by element: two rounds, each the
    largest logit not yet taken, weighted by its softmax over the logits not yet taken within a
    relative gap of 2 eps below it."""
    chosen, weights = [], []
    for _ in range(2):
        free = [e for e in range(len(logits)) if e not in chosen]
        best = max(free, key=lambda e: float(logits[e]))
        largest = float(logits[best])
        kept = [
            e
            for e in free
            if (largest - float(logits[e])) / max(abs(float(logits[e])), largest) <= 2 * eps
        ]
        total = sum(math.exp(float(logits[e]) - largest) for e in kept)
        chosen.append(best)
        weights.append(1.0 / total)
    return chosen, torch.tensor(weights, dtype=torch.float64)


def make_layer(fields):
    torch.manual_seed(0)
    layer = MegaMoE(MegaMoEConfig(**fields))
    with torch.no_grad():
        if layer.routing_table is not None:  # each token id's experts, distinct and random
            vocab, top_k = layer.routing_table.shape
            table = torch.rand(vocab, layer.config.num_experts).argsort(dim=1)[:, :top_k]
            layer.routing_table.copy_(table)
        # gate and up values past the SwiGLU limit, so the clamp matters
        layer.w13.mul_(4.0)
        if layer.shared_experts is not None and layer.shared_experts.gate_proj is not None:
            layer.shared_experts.gate_proj.weight.mul_(4.0)
            layer.shared_experts.up_proj.weight.mul_(4.0)
        if layer.gate.bias is not None:
            layer.gate.bias.normal_(0, 0.5)
        if layer.e_score_correction_bias is not None:
            layer.e_score_correction_bias.normal_(0, 0.3)
    return layer


@torch.no_grad()
def per_token_float64(
    layer: MegaMoE, x_TH: torch.Tensor, input_ids: torch.Tensor | None = None
) -> torch.Tensor:
    c = layer.config
    gate_weight = layer.gate.weight.double()
    w13, w2 = layer.w13.double(), layer.w2.double()
    out = []
    for t, x in enumerate(x_TH.double()):
        logits = gate_weight @ x
        if layer.gate.bias is not None:
            logits = logits + layer.gate.bias.double()
        if c.scoring == "sparsemixer":
            # its scores: the two experts' weights, 0 elsewhere (the top-2 below takes them)
            chosen, weights = sparsemixer_float64(logits, c.sparsemixer_eps)
            scores = torch.zeros_like(logits).index_put_((torch.tensor(chosen),), weights)
        elif c.scoring == "sqrtsoftplus":
            scores = torch.nn.functional.softplus(logits).sqrt()
        else:
            scores = torch.softmax(logits, 0) if c.scoring == "softmax" else torch.sigmoid(logits)
        choice = (logits if c.choice_on_logits else scores).clone()
        if c.use_correction_bias:
            choice = choice + layer.e_score_correction_bias.double()
        if c.num_groups > 1:
            per_group = (c.num_experts + c.num_identity_experts) // c.num_groups
            group_scores = []
            for g in range(c.num_groups):
                ranked = sorted(float(v) for v in choice[g * per_group : (g + 1) * per_group])
                group_scores.append(
                    ranked[-1] if c.group_score == "max" else ranked[-1] + ranked[-2]
                )
            kept = sorted(range(c.num_groups), key=lambda g: -group_scores[g])[: c.top_groups]
            choice = torch.tensor(
                [
                    float(choice[e]) if e // per_group in kept else c.dropped_group_score
                    for e in range(len(choice))
                ],
                dtype=torch.float64,
            )
        scored = c.num_experts + c.num_identity_experts
        chosen = sorted(range(scored), key=lambda e: -float(choice[e]))[: c.top_k]
        if c.routing_table_vocab_size:  # the row of the token's id
            chosen = layer.routing_table[int(input_ids.reshape(-1)[t])].tolist()
        weights = scores[chosen]
        if c.renormalize:
            weights = weights / weights.sum()
        weights = weights * c.routed_scaling_factor
        # the routed experts' row: the token, or its latent projection
        row = x if layer.latent_in is None else layer.latent_in.weight.double() @ x
        y = torch.zeros_like(row)
        for expert, weight in zip(chosen, weights, strict=True):
            if expert >= c.num_experts:  # an identity expert
                y += weight * row
                continue
            expert_input = weight * row if c.routing_weights_on_input else row
            gate_up = w13[expert] @ expert_input
            if layer.w13_bias is not None:
                gate_up = gate_up + layer.w13_bias[expert].double()
            if c.activation == "relu2":
                hidden = torch.relu(gate_up).square()
            else:
                hidden = swiglu_float64(
                    c, gate_up[: c.intermediate_size], gate_up[c.intermediate_size :]
                )
            expert_out = w2[expert] @ hidden
            if layer.w2_bias is not None:
                expert_out = expert_out + layer.w2_bias[expert].double()
            y += expert_out if c.routing_weights_on_input else weight * expert_out
        if layer.latent_out is not None:
            y = layer.latent_out.weight.double() @ y
        if layer.shared_experts is not None:
            shared = layer.shared_experts
            up, down = shared.up_proj.weight.double(), shared.down_proj.weight.double()
            if c.activation == "relu2":
                y += down @ torch.relu(up @ x).square()
                out.append(y)
                continue
            gate = shared.gate_proj.weight.double()
            if c.shared_swiglu == "routed":
                y += down @ swiglu_float64(c, gate @ x, up @ x)
            else:
                y += down @ (torch.nn.functional.silu(gate @ x) * (up @ x))
        out.append(y)
    y_TH = torch.stack(out)
    if layer.output_norm is not None:
        mean_square = y_TH.square().mean(-1, keepdim=True)
        y_TH = (
            y_TH * torch.rsqrt(mean_square + c.output_norm_eps) * layer.output_norm.weight.double()
        )
    return y_TH


def swiglu_float64(c: MegaMoEConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The routed experts' SwiGLU of `c` on one token's gate and up values."""
    if c.swiglu_limit is not None:
        gate, up = gate.clamp(max=c.swiglu_limit), up.clamp(-c.swiglu_limit, c.swiglu_limit)
    linear_gate = gate
    if c.swiglu_gate_softcap is not None:
        linear_gate = c.swiglu_gate_softcap * torch.tanh(gate / c.swiglu_gate_softcap)
    if c.swiglu_up_softcap is not None:
        up = c.swiglu_up_softcap * torch.tanh(up / c.swiglu_up_softcap)
    sigmoid_gate = gate + c.swiglu_gate_cubic * gate**3
    return linear_gate * torch.sigmoid(c.swiglu_alpha * sigmoid_gate) * (up + c.swiglu_up_offset)


@pytest.mark.parametrize(
    "fields",
    [
        GPT_OSS,
        LLAMA4,
        ERNIE,
        KOLIBRI,
        DEEPSEEK_V2,
        PHIMOE,
        MINIMAX_M3,
        NEMOTRON_H,
        NEMOTRON_H_LATENT,
        LONGCAT,
        INKLING2,
        AXK1,
        DEEPSEEK_V4,
        DEEPSEEK_V4_HASH,
        GEMMA4,
    ],
    ids=[
        "gpt-oss",
        "llama4",
        "ernie4_5",
        "kolibri",
        "deepseek-v2",
        "phimoe",
        "minimax-m3",
        "nemotron-h",
        "nemotron-h-latent",
        "longcat",
        "inkling2",
        "axk1",
        "deepseek-v4",
        "deepseek-v4-hash",
        "gemma4",
    ],
)
def test_layer_matches_per_token_float64_loop(fields):
    layer = make_layer(fields).eval()  # a sparsemixer layer does not train
    x = torch.randn(37, 32)
    input_ids = torch.randint(fields.get("routing_table_vocab_size", 1), (37,))
    expected = per_token_float64(layer, x, input_ids)
    actual = layer(x, input_ids=input_ids)
    assert ((actual.double() - expected).norm() / expected.norm()) < 1e-6


def test_the_sparsemixer_rounds_take_several_logits_in_the_test_inputs():
    layer = make_layer(PHIMOE)
    with torch.no_grad():
        logits = layer.gate(torch.randn(37, 32)).double()
    routed = [sparsemixer_float64(row, PHIMOE["sparsemixer_eps"])[1] for row in logits]
    assert sum(bool((w < 1).all()) for w in routed) > 5  # softmaxes over more than one logit


def test_a_sparsemixer_layer_refuses_to_train():
    layer = make_layer(PHIMOE).train()
    with pytest.raises(RuntimeError, match=r"samples its experts in training.*\.eval\(\)"):
        layer(torch.randn(3, 32))
    with torch.no_grad():  # training mode without gradients: the inference routing
        expected = layer(torch.randn(3, 32, generator=torch.Generator().manual_seed(1)))
    actual = layer.eval()(torch.randn(3, 32, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(actual, expected)


def random_layer_fields(rng: random.Random) -> dict:
    """A random valid MegaMoEConfig of every routing and expert-math field this file covers.
    Dropped groups score -inf where choice scores can be negative (a bias, the logits): with
    0.0 there, the dropped experts tie, and which of them torch.topk takes is unspecified."""
    while True:
        experts = rng.choice([2, 3, 4, 6, 8, 12, 16, 40])
        scoring = rng.choice(["softmax", "sigmoid", "sqrtsoftplus", "sparsemixer"])
        fields = dict(
            hidden_size=rng.choice([8, 16, 24]),
            intermediate_size=rng.choice([4, 8, 12]),
            num_experts=experts,
            scoring=scoring,
            renormalize=rng.random() < 0.5,
            routed_scaling_factor=rng.choice([1.0, 2.5]),
            router_bias=rng.random() < 0.3,
            expert_bias=rng.random() < 0.3,
            num_shared_experts=int(rng.random() < 0.3),
        )
        if rng.random() < 0.2:
            fields.update(output_norm_eps=rng.choice([1e-6, 0.1]))
        if rng.random() < 0.2:
            fields.update(latent_size=rng.choice([4, 12, 32]))
        elif rng.random() < 0.2:
            fields.update(num_identity_experts=rng.choice([1, 2, experts]))
        expert_activation = rng.choice(["swiglu", "clamped", "softcapped", "geglu", "relu2"])
        if expert_activation == "clamped":
            fields.update(swiglu_limit=7.0, swiglu_alpha=1.702, swiglu_up_offset=1.0)
        if expert_activation == "geglu":
            fields.update(swiglu_alpha=GEGLU.alpha, swiglu_gate_cubic=GEGLU.gate_cubic)
        if expert_activation == "softcapped":  # Inkling2's caps, one of them at times
            fields.update(
                swiglu_gate_softcap=rng.choice([None, 0.5]),
                swiglu_up_softcap=rng.choice([1.0, 25.0]),
            )
        if expert_activation == "relu2":
            fields.update(activation="relu2")
        elif fields["num_shared_experts"]:
            fields.update(shared_swiglu=rng.choice(["silu", "routed"]))
        if scoring == "sparsemixer":
            fields.update(top_k=2, sparsemixer_eps=rng.choice([0.0, 0.01, 0.3, 1.0]))
            return fields
        if not fields.get("num_identity_experts") and rng.random() < 0.15:
            # DeepSeek-V4's hash layers: the experts from a table of token ids
            fields.update(
                top_k=rng.randint(1, experts), routing_table_vocab_size=rng.choice([1, 30])
            )
            return fields
        scored = experts + fields.get("num_identity_experts", 0)
        groups = rng.choice([g for g in (1, 2, 4) if scored % g == 0])
        top_groups = rng.randint(1, groups)
        biased = rng.random() < 0.5
        fields.update(
            top_k=rng.randint(1, top_groups * (scored // groups)),
            num_groups=groups,
            top_groups=top_groups,
            use_correction_bias=biased,
            choice_on_logits=biased and rng.random() < 0.3,
            group_score="max" if scored // groups < 2 else rng.choice(["top2_sum", "max"]),
            dropped_group_score=float("-inf") if biased else rng.choice([float("-inf"), 0.0]),
        )
        return fields


@pytest.mark.parametrize("seed", range(40))
def test_random_layers_match_the_float64_loop(seed):
    rng = random.Random(seed)
    fields = random_layer_fields(rng)
    layer = make_layer(fields).eval()
    with torch.no_grad():
        if layer.w13_bias is not None:
            layer.w13_bias.normal_()
            layer.w2_bias.normal_()
    x = torch.randn(rng.choice([1, 5, 37]), fields["hidden_size"])
    input_ids = torch.randint(fields.get("routing_table_vocab_size", 1), (x.shape[0],))
    with torch.no_grad():
        actual = layer(x, input_ids=input_ids)
    expected = per_token_float64(layer, x, input_ids)
    assert ((actual.double() - expected).norm() / expected.norm()) < 1e-6, fields


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(24))
@torch.no_grad()
def test_random_layers_route_on_the_device_as_on_the_torch_path(seed):
    """The fused path (routing, dispatch and combine kernels; cutedsl experts, grouped_mm for
    ungated ones) of a random layer at sizes the kernels take, against the same layer's torch
    path on the same backend: the same router logits, outputs within the routing weights'
    ulps, and bitwise repeatable."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rng = random.Random(seed)
    fields = dict(random_layer_fields(rng), hidden_size=512, intermediate_size=256)
    # ungated experts: the fused path around grouped_mm (the cutedsl kernels compute gated ones)
    backend = "grouped_mm" if fields.get("activation") == "relu2" else "cutedsl"
    torch.manual_seed(seed)
    fused = MegaMoE(
        MegaMoEConfig(**fields, backend=backend),
        device="cuda",
        dtype=torch.bfloat16,
    )
    ok, why = fused.fused_path_status()
    if not ok:
        pytest.skip(why)
    if fused.e_score_correction_bias is not None:
        fused.e_score_correction_bias.normal_(0, 0.05)
    plain = MegaMoE(
        MegaMoEConfig(**fields, layer_path="torch", backend=backend),
        device="cuda",
        dtype=torch.bfloat16,
    )
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(rng.choice([1, 77, 700]), 512, device="cuda", dtype=torch.bfloat16)
    # a layer routing by token id takes them (the others ignore them)
    vocab = fields.get("routing_table_vocab_size", 1)
    input_ids = torch.randint(vocab, (x.shape[0],), device="cuda")
    y, logits = fused(x, input_ids=input_ids, return_router_logits=True)
    expected, expected_logits = plain(x, input_ids=input_ids, return_router_logits=True)
    assert torch.equal(logits, expected_logits)
    assert torch.equal(fused(x, input_ids=input_ids), y)
    # shared experts may join the fused path's batch, their intermediate rounded once where the
    # torch path's MLP rounds each projection's output: about a bf16 ulp of their share (0.4%
    # at one token on an H100)
    tolerance = 8e-3 if fields["num_shared_experts"] else 2e-3
    assert relative_l2_error(y.float(), expected.float()) < tolerance, fields


def test_the_swiglu_limit_is_reached_by_the_test_inputs():
    layer = make_layer(GPT_OSS)
    x = torch.randn(37, 32)
    with torch.no_grad():
        gate_up = torch.einsum("th,eih->tei", x, layer.w13) + layer.w13_bias
    assert (gate_up.abs() > GPT_OSS["swiglu_limit"]).any()
    shared = make_layer(MINIMAX_M3).shared_experts
    with torch.no_grad():
        for projection in (shared.gate_proj, shared.up_proj):
            assert (projection(x).abs() > MINIMAX_M3["swiglu_limit"]).any()


def test_the_softcaps_bound_the_values_the_test_inputs_reach():
    layer = make_layer(INKLING2).eval()
    x = torch.randn(37, 32)
    with torch.no_grad():
        gate_up = torch.einsum("th,eih->tei", x, layer.w13)
        assert (gate_up[..., :16].abs() > 2 * INKLING2["swiglu_gate_softcap"]).any()
        assert (gate_up[..., 16:].abs() > 2 * INKLING2["swiglu_up_softcap"]).any()
        plain = make_layer(dict(INKLING2, swiglu_gate_softcap=None, swiglu_up_softcap=None)).eval()
        assert relative_l2_error(layer(x), plain(x)) > 1e-1


def test_the_output_norm_normalises_after_the_shared_experts_and_is_checked():
    layer = make_layer(AXK1).eval()
    assert torch.equal(layer.output_norm.weight, torch.ones(32))  # as transformers' RMSNorms
    with torch.no_grad():
        weight = layer.output_norm.weight.normal_().clone()
        x = torch.randn(37, 32)
        y = layer(x)
        layer.output_norm = None  # the same layer without its norm
        unnormed = layer(x)
    expected = unnormed * torch.rsqrt(unnormed.square().mean(-1, keepdim=True) + 1e-6) * weight
    torch.testing.assert_close(y, expected)
    assert relative_l2_error(unnormed, expected) > 1e-1
    for value in (0.0, -1e-6, math.inf):
        with pytest.raises(ValueError, match="output_norm_eps must be a finite number > 0"):
            MegaMoEConfig(**dict(AXK1, output_norm_eps=value))
    assert "output_norm_eps=1e-06" in repr(make_layer(AXK1))


def test_the_softcaps_are_checked():
    for name in ("swiglu_gate_softcap", "swiglu_up_softcap"):
        for value in (0.0, -1.0, math.inf):
            with pytest.raises(ValueError, match=f"{name} must be a finite number > 0 or None"):
                MegaMoEConfig(**dict(INKLING2, **{name: value}))
    with pytest.raises(ValueError, match="activation='relu2'.*takes no SwiGLU"):
        MegaMoEConfig(**dict(NEMOTRON_H, swiglu_up_softcap=25.0))


def test_shared_experts_with_the_routed_swiglu_differ_from_silu_ones():
    """The MiniMax-M3 layer's shared experts are not computed as silu(gate) * up."""
    layer = make_layer(MINIMAX_M3).eval()
    x = torch.randn(37, 32)
    with torch.no_grad():
        routed = layer(x)
        silu = make_layer(dict(MINIMAX_M3, shared_swiglu="silu")).eval()(x)
    assert relative_l2_error(routed, silu) > 1e-2


def test_shared_swiglu_is_checked():
    with pytest.raises(ValueError, match="shared_swiglu must be one of"):
        MegaMoEConfig(**dict(MINIMAX_M3, shared_swiglu="gelu"))
    with pytest.raises(ValueError, match=r"shared_swiglu='routed' needs num_shared_experts >= 1"):
        MegaMoEConfig(**dict(MINIMAX_M3, num_shared_experts=0, shared_intermediate_size=None))


def test_expert_math_trains_through_the_reference_backend():
    layer = make_layer(GPT_OSS)
    assert layer.backend == "reference"  # a CPU layer (grouped_mm computes it on a GPU)
    x = torch.randn(9, 32, requires_grad=True)
    layer(x).square().sum().backward()
    for parameter in (x, layer.w13, layer.w2, layer.w13_bias, layer.w2_bias, layer.gate.bias):
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0


def grouped_mm_runs_on_cpu() -> bool:
    """Whether this torch's torch._grouped_mm has a CPU kernel (the backend itself then runs
    on a CPU; megamoe picks it on an sm_90 GPU only)."""
    try:
        torch._grouped_mm(
            torch.zeros(2, 8, 16, dtype=torch.bfloat16),
            torch.zeros(2, 16, 16, dtype=torch.bfloat16),
        )
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not grouped_mm_runs_on_cpu(), reason="this torch has no CPU torch._grouped_mm")
@pytest.mark.parametrize(
    "fields",
    [GPT_OSS, LLAMA4, dict(NEMOTRON_H_LATENT, expert_bias=True), LONGCAT, INKLING2, AXK1],
    ids=["gpt-oss", "llama4", "nemotron-h-latent", "longcat", "inkling2", "axk1"],
)
def test_grouped_mm_computes_and_trains_the_layer_as_the_reference_does(monkeypatch, fields):
    from megamoe_runtime import experts

    # grouped_mm as on an sm_90 GPU: this CPU's torch._grouped_mm computes it
    monkeypatch.setattr(experts, "grouped_mm_status", lambda device: (True, "an sm_90 GPU"))
    layer = make_layer(fields).to(torch.bfloat16)
    with torch.no_grad():
        if layer.w13_bias is not None:
            layer.w13_bias.normal_(0, 1.0)
            layer.w2_bias.normal_(0, 0.5)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(37, 32, generator=generator).to(torch.bfloat16)
    probe = torch.randn(37, 32, generator=generator)
    with torch.no_grad():
        expected = per_token_float64(layer, x)
    results = {}
    for backend in ("grouped_mm", "reference"):
        layer.use_backend(backend)
        assert layer.backend == backend
        layer.zero_grad()
        leaf = x.clone().requires_grad_()
        y = layer(leaf)
        (y.float() * probe).sum().backward()
        # with routing weights on the input the router's weight learns through the experts
        parameters = (
            layer.w13,
            layer.w2,
            layer.w13_bias,
            layer.w2_bias,
            layer.gate.bias,
            layer.gate.weight,
        )
        results[backend] = (
            y.detach(),
            [leaf.grad, *(p.grad for p in parameters if p is not None)],
        )
    y, gradients = results["grouped_mm"]
    assert ((y.double() - expected).norm() / expected.norm()) < 1e-2
    for actual, reference in zip(gradients, results["reference"][1], strict=True):
        assert torch.isfinite(actual).all() and reference.abs().sum() > 0
        relative = (actual.double() - reference.double()).norm() / reference.double().norm()
        assert relative < 1e-2  # bf16 gradients of the same bf16 layer


def test_the_cutedsl_backend_is_not_refused_for_biases_and_the_clamped_swiglu():
    # refused later only for the device (a CPU here), not for the expert math
    layer = MegaMoE(MegaMoEConfig(**GPT_OSS, backend="cutedsl"))
    layer.use_backend("reference")
    layer.use_backend("cutedsl")


def test_ungated_experts_are_refused_by_the_cutedsl_backend_alone(monkeypatch):
    from megamoe_runtime import experts

    for status in ("grouped_mm_status", "cutedsl_status"):
        monkeypatch.setattr(experts, status, lambda device, *_, **__: (True, "an sm_90 GPU"))
    layer = make_layer(NEMOTRON_H)
    assert layer.backend == "grouped_mm"
    assert "cutedsl: the cutedsl kernels compute gated (SwiGLU) experts" in layer.backend_reason
    with pytest.raises(ValueError, match=r"backend 'cutedsl' cannot run.*ungated relu\^2"):
        layer.use_backend("cutedsl")
        _ = layer.backend


def test_the_swiglu_variants_take_the_cutedsl_backend_in_bf16_and_fp8(monkeypatch):
    from megamoe_runtime import experts

    for status in ("grouped_mm_status", "cutedsl_status"):
        monkeypatch.setattr(experts, status, lambda device, *_, **__: (True, "an sm_90 GPU"))
    for fields in (INKLING2, GEMMA4, DEEPSEEK_V4):
        assert make_layer(fields).backend == "cutedsl"
        fp8 = MegaMoE(MegaMoEConfig(**fields, weight_dtype="fp8"))
        assert fp8.backend == "cutedsl" and fp8.expert_weight_pack().swiglu == fp8.config.swiglu
    for refused in (dict(GPT_OSS), dict(NEMOTRON_H), dict(LLAMA4)):
        with pytest.raises(ValueError, match=r"weight_dtype=.fp8. does not combine with"):
            MegaMoEConfig(**refused, weight_dtype="fp8")


def test_identity_experts_are_chosen_and_their_pairs_skip_the_expert_mlp(monkeypatch):
    layer = make_layer(LONGCAT).eval()
    assert layer.gate.weight.shape == (12, 32) and layer.e_score_correction_bias.shape == (12,)
    assert layer.w13.shape[0] == 8
    x = torch.randn(37, 32)
    with torch.no_grad():
        ids, _ = route(
            layer.router_logits(x),
            layer.config.router,
            correction_bias_E=layer.e_score_correction_bias,
        )
    assert (ids >= 8).any() and (ids < 8).any()
    rows_seen = []
    compute = layer._expert_compute
    monkeypatch.setattr(
        layer,
        "_expert_compute",
        lambda batch: rows_seen.append(int(batch.expert_offsets[-1])) or compute(batch),
    )
    with torch.no_grad():
        layer(x)
    assert rows_seen == [int((ids < 8).sum())]  # the routed pairs' rows alone
    ok, why = layer.fused_path_status("cuda")
    assert not ok and "num_identity_experts" in why


def test_a_latent_layer_takes_the_torch_path_and_says_why():
    layer = make_layer(NEMOTRON_H_LATENT)
    assert layer.w13.shape == (8, 16, 24) and layer.w2.shape == (8, 24, 16)
    assert layer.latent_in.weight.shape == (24, 32) and layer.latent_out.weight.shape == (32, 24)
    assert layer.shared_experts.up_proj.weight.shape == (24, 32)  # on the tokens themselves
    ok, why = layer.fused_path_status("cuda")
    assert not ok and "latent_size" in why
    with pytest.raises(ValueError, match="latent_size must be an int >= 1"):
        MegaMoEConfig(**dict(NEMOTRON_H, latent_size=0))
    with pytest.raises(ValueError, match=r"latent_size \(the batch holds the latent rows\)"):
        MegaMoEConfig(**dict(NEMOTRON_H_LATENT, activation="swiglu", shared_experts_path="batch"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(swiglu_limit=7.0), "takes no SwiGLU"),
        (dict(shared_swiglu="routed"), "takes no SwiGLU"),
        (dict(weight_dtype="fp8"), r"weight_dtype='fp8' does not combine with ungated relu\^2"),
        (dict(activation="gelu"), "activation must be one of"),
        (dict(num_identity_experts=-1), "num_identity_experts must be an int >= 0"),
        (dict(num_identity_experts=2, latent_size=8), "does not combine with latent_size"),
    ],
)
def test_bad_ungated_configs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        MegaMoEConfig(**dict(NEMOTRON_H, **fields))


def test_identity_experts_refuse_routing_weights_on_input_and_expert_parallelism():
    with pytest.raises(ValueError, match="does not combine with routing_weights_on_input"):
        MegaMoEConfig(**dict(LONGCAT, routing_weights_on_input=True))
    group = object()  # refused before the group is used
    with pytest.raises(ValueError, match="num_identity_experts: the expert-parallel"):
        MegaMoE(MegaMoEConfig(**LONGCAT), process_group=group)


@pytest.mark.parametrize("backend", ["grouped_mm", "cutedsl"])
def test_every_backend_is_chosen_for_routing_weights_on_input(monkeypatch, backend):
    from megamoe_runtime import experts

    # the backends as on an sm_90 GPU: nothing in the Llama 4 math steers the choice
    for status in ("grouped_mm_status", "cutedsl_status"):
        monkeypatch.setattr(experts, status, lambda device, *_, **__: (True, "an sm_90 GPU"))
    layer = make_layer(LLAMA4)
    layer.use_backend(backend)
    assert layer.backend == backend
    layer.use_backend("auto")
    assert layer.backend == "cutedsl"


def test_the_fused_path_is_not_refused_for_routing_weights_on_input():
    # refused for the device only (a CPU here), naming the device, not the feature
    layer = MegaMoE(MegaMoEConfig(**LLAMA4))
    ok, why = layer.fused_path_status()
    assert not ok and "routing_weights_on_input" not in why and "GPU" in why
    with pytest.raises(ValueError, match="cannot run on cpu"):
        MegaMoE(MegaMoEConfig(**LLAMA4, layer_path="fused")).fused_path_status()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(gather_rows=True), "gather_rows=True"),
        (dict(weight_dtype="fp8"), "weight_dtype='fp8'"),
    ],
)
def test_what_cannot_compute_routing_weights_on_input_is_refused_naming_it(fields, message):
    with pytest.raises(ValueError, match=message) as refusal:
        MegaMoEConfig(**LLAMA4, **fields)
    assert "routing_weights_on_input=True" in str(refusal.value)


def test_the_weight_pack_carries_the_biases_and_the_swiglu():
    layer = make_layer(GPT_OSS)
    pack = layer.expert_weight_pack()
    assert pack.w13_bias_E2I is not None and pack.w2_bias_EH is not None
    assert (pack.swiglu.limit, pack.swiglu.alpha, pack.swiglu.up_offset) == (7.0, 1.702, 1.0)
    assert pack.expert_math


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(GPT_OSS, swiglu_limit=0.0), "swiglu_limit"),
        (dict(GPT_OSS, swiglu_limit=math.inf), "swiglu_limit"),
        (dict(GPT_OSS, swiglu_alpha=math.nan), "swiglu_alpha"),
        (dict(DEEPSEEK_V2, group_score="min"), "group_score"),
    ],
)
def test_bad_expert_math_configs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        MegaMoEConfig(**fields)


def test_a_table_routed_layer_takes_input_ids_and_checks_them():
    layer = make_layer(DEEPSEEK_V4_HASH).eval()
    x = torch.randn(5, 32)
    with pytest.raises(TypeError, match="pass input_ids"):
        layer(x)
    with pytest.raises(TypeError, match="input_ids must hold integers"):
        layer(x, input_ids=torch.zeros(5))
    with pytest.raises(ValueError, match=r"one id per token of x \(5 on cpu\)"):
        layer(x, input_ids=torch.zeros(4, dtype=torch.long))
    checked = MegaMoE(MegaMoEConfig(**DEEPSEEK_V4_HASH, check_inputs=True))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 50\)"):
        checked(x, input_ids=torch.tensor([0, 1, 2, 3, 50]))
    # the same token ids, the same experts: token ids in any shape of x's tokens
    ids = torch.randint(50, (5,))
    assert torch.equal(
        layer(x, input_ids=ids), layer(x.view(1, 5, 32), input_ids=ids.view(1, 5))[0]
    )
    # and in any integer dtype (uint8 ids are ids, not a mask)
    for dtype in (torch.uint8, torch.int16, torch.int32):
        assert torch.equal(layer(x, input_ids=ids.to(dtype)), layer(x, input_ids=ids))
    # on a GPU the fused path places the table's experts (test_fused_layer.py)
    assert "sm_90 CUDA GPU" in layer.fused_path_status("cpu")[1]


def test_a_routing_table_is_checked_as_it_loads():
    layer = make_layer(DEEPSEEK_V4_HASH)
    state = layer.state_dict()
    assert state["routing_table"].shape == (50, 3)
    bad = dict(state, routing_table=torch.full((50, 3), 8))
    with pytest.raises(ValueError, match=r"routing_table names experts outside \[0, 8\)"):
        layer.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"routing_table must have shape \[50, 3\]"):
        layer.load_state_dict(dict(state, routing_table=torch.zeros(50, 2, dtype=torch.long)))
    with pytest.raises(TypeError, match="routing_table must be an integer tensor"):
        layer.load_state_dict(dict(state, routing_table=torch.zeros(50, 3)))
    layer.load_state_dict(dict(state, routing_table=torch.zeros(50, 3, dtype=torch.long)))
    assert not bool(layer.routing_table.any())


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(routing_table_vocab_size=-1), "routing_table_vocab_size must be an int >= 0"),
        (dict(use_correction_bias=True), "does not combine with use_correction_bias=True"),
        (dict(scoring="sparsemixer", top_k=2), "does not combine with scoring='sparsemixer'"),
        (dict(num_groups=2), "does not combine with num_groups=2"),
    ],
)
def test_bad_table_routing_configs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        MegaMoEConfig(**dict(DEEPSEEK_V4_HASH, **fields))


def test_routed_experts_compute_the_routing_they_are_given_and_check_it():
    layer = make_layer(ERNIE).eval()
    x = torch.randn(9, 32)
    with torch.no_grad():
        ids, weights = route(
            layer.router_logits(x),
            layer.config.router,
            correction_bias_E=layer.e_score_correction_bias,
        )
        assert torch.equal(layer.routed_experts(x, ids.long(), weights), layer(x))
    with pytest.raises(ValueError, match=r"topk_ids \[tokens, top_k=2\]"):
        layer.routed_experts(x, ids[:, :1], weights[:, :1])
    with pytest.raises(ValueError, match="topk_weights must be shaped as topk_ids"):
        layer.routed_experts(x, ids, weights[:, :1])
    checked = MegaMoE(MegaMoEConfig(**ERNIE, check_inputs=True))
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 8\)"):
        checked.routed_experts(x, torch.full_like(ids, 8), weights)


def test_routed_experts_take_a_function_of_the_expert_rows_before_the_combine():
    layer = make_layer(ERNIE).eval()
    x = torch.randn(9, 32)
    with torch.no_grad():
        ids, weights = route(
            layer.router_logits(x),
            layer.config.router,
            correction_bias_E=layer.e_score_correction_bias,
        )
        doubled = layer.routed_experts(x, ids, weights, expert_rows_fn=lambda rows: 2 * rows)
        torch.testing.assert_close(doubled, 2 * layer.routed_experts(x, ids, weights))
    identity = make_layer(LONGCAT).eval()
    with pytest.raises(ValueError, match="expert_rows_fn"):
        identity.routed_experts(
            x, ids.clamp(max=2).repeat(1, 2)[:, :3], weights.repeat(1, 2)[:, :3], expert_rows_fn=abs
        )


@pytest.mark.parametrize("fields", [LLAMA4, LONGCAT], ids=["weights_on_input", "identity"])
def test_a_function_of_the_expert_rows_is_refused_where_rows_are_not_the_experts_alone(fields):
    """routed_experts' expert_rows_fn takes the expert MLP's output rows: rows scaled by their
    weight before the experts, or identity experts' token rows, are refused on every path."""
    layer = make_layer(fields)
    top_k = fields["top_k"]
    x = torch.randn(5, 32)
    ids = torch.stack([torch.randperm(8)[:top_k] for _ in range(5)])
    with pytest.raises(ValueError, match="expert_rows_fn: rows of the expert MLP's output"):
        layer.routed_experts(x, ids, torch.rand(5, top_k), expert_rows_fn=torch.nn.Identity())


def test_the_router_bias_is_cast_to_fp32_once_and_again_when_it_changes():
    layer = MegaMoE(MegaMoEConfig(**GPT_OSS), dtype=torch.bfloat16)
    x_TH = torch.randn(5, GPT_OSS["hidden_size"], dtype=torch.bfloat16)
    with torch.no_grad():
        layer.gate.bias.normal_(0, 0.5)
        expected = x_TH.float() @ layer.gate.weight.float().t() + layer.gate.bias.float()
        logits = layer.router_logits(x_TH)
        bias = layer.gate.bias

        def kept_cast():  # the cached fp32 bias, None where it was not kept
            return layer._gate_bias_float32.get((bias,), lambda: None, context=(bias.device,))

        cast = kept_cast()
        assert isinstance(cast, torch.Tensor) and cast.dtype == torch.float32
        layer.router_logits(x_TH)
        # an inference forward reuses the fp32 bias (no cast launched per forward)...
        assert kept_cast() is cast
        torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
        # ...until the bias changes in place
        layer.gate.bias.add_(1.0)
        changed = x_TH.float() @ layer.gate.weight.float().t() + layer.gate.bias.float()
        torch.testing.assert_close(layer.router_logits(x_TH), changed, rtol=1e-6, atol=1e-6)
    # with autograd the cast is recorded, so the bias gets its gradient
    layer.gate.bias.requires_grad_(True)
    layer.router_logits(x_TH).sum().backward()
    assert layer.gate.bias.grad is not None
