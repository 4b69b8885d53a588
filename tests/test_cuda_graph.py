"""CUDA graphs: the MegaMoE forward (route, local dispatch, expert compute, combine) captured once
with a fixed capacity, then replayed on new hidden states, so every replay routes differently
(different per-expert counts); every replay must match an eager fp32-oracle layer. Plain experts
and gpt-oss's (expert biases, the clamped SwiGLU)."""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels.reference import relative_l2_error
from megamoe_runtime.experts import backend_status
from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.layer import MegaMoE

pytestmark = pytest.mark.gpu

TOKENS, TOP_K = 96, 4
EXPERT_MATH = {
    "plain": {},
    "gpt-oss": dict(expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702, swiglu_up_offset=1.0),
}


def _layer(backend: str, **overrides) -> MegaMoE:
    config = MegaMoEConfig(
        hidden_size=512,
        intermediate_size=384,
        num_experts=16,
        top_k=TOP_K,
        backend=backend,
        capacity=TOKENS * TOP_K,
        **overrides,
    )
    torch.manual_seed(0)
    return MegaMoE(config, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("expert_math", sorted(EXPERT_MATH))
@pytest.mark.parametrize("backend", ["cutedsl", "grouped_mm"])
def test_captured_forward_replays_correctly_with_new_routings(backend, expert_math):
    if not torch.cuda.is_available() or not backend_status(backend, torch.device("cuda"))[0]:
        pytest.skip(f"backend {backend} cannot run here")
    layer = _layer(backend, **EXPERT_MATH[expert_math])
    if layer.w13_bias is not None:
        with torch.no_grad():  # biases that matter next to the products
            layer.w13_bias.normal_(0, 1.0)
            layer.w2_bias.normal_(0, 0.5)
    oracle = _layer("reference", **EXPERT_MATH[expert_math])
    oracle.load_state_dict(layer.state_dict())
    x_TH = torch.randn(TOKENS, 512, device="cuda", dtype=torch.bfloat16)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        layer(x_TH)  # compiles the kernels and prepares the weights outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        y_TH = layer(x_TH)

    counts_seen = set()
    for seed in range(5):
        generator = torch.Generator(device="cuda").manual_seed(100 + seed)
        # a per-replay skew makes the per-expert counts differ a lot between replays
        x_TH.copy_(torch.randn(TOKENS, 512, device="cuda", generator=generator) * (1 + seed))
        graph.replay()
        with torch.no_grad():
            expected_TH = oracle(x_TH)
            logits = oracle.router_logits(x_TH)
        counts_seen.add(
            tuple(torch.bincount(logits.topk(TOP_K).indices.flatten(), minlength=16).tolist())
        )
        error = relative_l2_error(y_TH, expected_TH)
        assert error < 1e-2, f"replay {seed}: rel-L2 {error}"
    assert len(counts_seen) > 1
