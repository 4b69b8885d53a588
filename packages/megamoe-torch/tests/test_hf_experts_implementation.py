"""megamoe as transformers' experts implementation (hf/experts_implementation.py): a tiny model of
each family computed with experts_implementation="megamoe" against "eager"."""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels.reference import relative_l2_error

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

from hf_family_walk import VOCAB, tiny_model  # noqa: E402
from megamoe_torch import UnsupportedBlockError, register_experts_implementation  # noqa: E402
from megamoe_torch.hf.experts_implementation import _layer  # noqa: E402
from test_hf_models import tiny_model as configured_model  # noqa: E402


@pytest.fixture(autouse=True)
def _registered():
    assert register_experts_implementation(backend="reference") == "megamoe"


def _experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "is_concatenated")]


def _logits(model, implementation, input_ids):
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        return model(input_ids).logits


# blocks swap_moe_blocks replaces (gpt-oss: biases and its clamped SwiGLU; DeepSeek-V4: clamped,
# a routing table) and blocks it cannot (Inkling: router gammas on its shared experts; Zaya:
# its router takes the previous layer's router state; Gemma 4: GeGLU experts in its decoder
# layer; Muse Spark: a norm of each expert's output, applied by megamoe; Ergo: per-expert norms
# its own code applies around relu^2 experts)
@pytest.mark.parametrize(
    "family",
    ["qwen3_moe", "gpt_oss", "deepseek_v4", "inkling", "zaya", "gemma4", "muse_spark", "ergo"],
)
def test_a_model_runs_its_experts_on_megamoe_as_on_eager(family):
    if family not in transformers.models.__dict__ and not hasattr(transformers.models, family):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    model = tiny_model(family)
    input_ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = _logits(model, "eager", input_ids)
    assert relative_l2_error(_logits(model, "megamoe", input_ids), expected) < 1e-5


def test_the_layer_shares_the_modules_parameters_and_follows_their_updates():
    model = tiny_model("qwen3_moe")
    input_ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    _logits(model, "megamoe", input_ids)
    experts = _experts_modules(model)[0]
    layer = _layer(experts, model.config.num_experts_per_tok, torch.float32)
    assert layer.w13 is experts.gate_up_proj and layer.w2 is experts.down_proj
    with torch.no_grad():
        for module in _experts_modules(model):
            module.down_proj.mul_(2.0)
    expected = _logits(model, "eager", input_ids)
    assert relative_l2_error(_logits(model, "megamoe", input_ids), expected) < 1e-5


def test_gradients_reach_the_modules_parameters():
    model = tiny_model("qwen3_moe")
    input_ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    grads = {}
    for implementation in ("eager", "megamoe"):
        model.zero_grad()
        model.set_experts_implementation(implementation)
        model(input_ids).logits.square().sum().backward()
        experts = _experts_modules(model)[0]
        grads[implementation] = experts.gate_up_proj.grad.clone()
    assert relative_l2_error(grads["megamoe"], grads["eager"]) < 1e-4


def test_what_megamoe_does_not_compute_is_refused_with_the_reason():
    model = configured_model("qwen3_moe", hidden_act="gelu")  # the erf GELU
    experts = _experts_modules(model)[0]
    x = torch.randn(3, model.config.hidden_size)
    ids = torch.zeros(3, 2, dtype=torch.long)
    weights = torch.full((3, 2), 0.5)
    model.set_experts_implementation("megamoe")
    with pytest.raises(UnsupportedBlockError, match="SiLU- or GELU-gated MLP"):
        experts(x, ids, weights)
    experts._is_expert_parallel = True
    with pytest.raises(UnsupportedBlockError, match="expert parallelism"):
        experts(x, ids, weights)


def test_bad_options_are_refused():
    with pytest.raises(TypeError, match=r"unexpected options \['routed_scaling_factor'\]"):
        register_experts_implementation(routed_scaling_factor=2.0)
    with pytest.raises(TypeError, match=r"unexpected options \['process_group'\]"):
        register_experts_implementation(process_group=None)


@pytest.mark.gpu
def test_a_bf16_model_on_the_gpu_runs_its_experts_on_megamoe():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    register_experts_implementation()  # backend "auto": the best one that runs here
    model = tiny_model("qwen3_moe").to("cuda", torch.bfloat16)
    input_ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    input_ids = input_ids.cuda()
    expected = _logits(model, "eager", input_ids)
    actual = _logits(model, "megamoe", input_ids)
    assert relative_l2_error(actual.float(), expected.float()) < 2e-2
    assert torch.equal(_logits(model, "megamoe", input_ids), actual)


def test_a_compiled_model_runs_its_experts_on_megamoe():
    # the layer lookup (and the first call's read of the experts) runs outside the trace: a
    # graph break at each experts module
    model = tiny_model("qwen3_moe")
    input_ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = _logits(model, "eager", input_ids)
    model.set_experts_implementation("megamoe")
    with torch.no_grad():
        actual = torch.compile(model)(input_ids).logits
    assert relative_l2_error(actual, expected) < 1e-5
