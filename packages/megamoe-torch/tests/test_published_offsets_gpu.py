"""The layer with the routing kernel publishing the batch offsets before it ends and the decode
gate-up GEMM polling for them (megamoe_kernels' knobs.GATE_UP_POLLS_OFFSETS_MAX_TOKENS, one
token by default; here every call size): the bits of the layer without, on the launched and the
replayed forwards, with bf16 experts (copied and gathered rows) and FP8 ones, at the dims of
the geometries whose decode forwards it is for."""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels.shim import expert_gemm, knobs
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_torch import MegaMoE, MegaMoEConfig

pytestmark = pytest.mark.gpu


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _layer(config: MegaMoEConfig, state: dict | None) -> MegaMoE:
    torch.manual_seed(0)
    layer = MegaMoE(config, device="cuda", dtype=torch.bfloat16)
    if state is not None:
        layer.load_state_dict(state)
    return layer.eval()


def _forwards(layer: MegaMoE, tokens_list: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each batch of tokens three times: launched, captured, replayed (eager_graph_tokens)."""
    with torch.no_grad():
        return [layer(x).clone() for x in tokens_list for _ in range(3)]


@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize(
    "geometry, weight_dtype",
    [
        ("qwen3-30b-a3b", None),
        ("qwen3-30b-a3b", "fp8"),
        ("dsv3-ep8-local", "fp8"),
        ("mixtral-8x7b", None),
    ],
)
def test_polling_the_published_offsets_gives_the_same_bits(monkeypatch, geometry, weight_dtype):
    config = MegaMoEConfig.from_geometry(
        GEOMETRIES[geometry], backend="cutedsl", weight_dtype=weight_dtype
    )
    hidden = config.hidden_size
    generator = torch.Generator(device="cuda").manual_seed(1)
    # one token (copied rows), 2 and 16 (gathered in bf16), 300 (decode tiles), 2048
    # (prefill tiles, which wait for the routing kernel to end)
    tokens_counts = (1, 2, 16, 300, 2048)
    tokens_list = [
        torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
        for tokens in tokens_counts
    ]
    bound = set(expert_gemm._LAUNCHERS)  # keys end (..., offsets_published, device)
    monkeypatch.setattr(knobs, "GATE_UP_POLLS_OFFSETS_MAX_TOKENS", -1)
    waiting = _layer(config, None)
    expected = _forwards(waiting, tokens_list)
    assert not any(key[-2] for key in set(expert_gemm._LAUNCHERS) - bound)
    bound = set(expert_gemm._LAUNCHERS)

    monkeypatch.setattr(knobs, "GATE_UP_POLLS_OFFSETS_MAX_TOKENS", max(tokens_counts))
    polling = _layer(config, waiting.state_dict())
    del waiting
    got = _forwards(polling, tokens_list)
    published = [key for key in set(expert_gemm._LAUNCHERS) - bound if key[-2]]
    assert published and all(key[0].startswith("gate_up") for key in published)
    assert all(
        launcher.publishes_offsets for launcher in polling._device_routed._route_launchers.values()
    )
    for index, (y, y_expected) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(y, y_expected), (geometry, weight_dtype, index // 3, index % 3)
