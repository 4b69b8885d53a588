"""The whole layer against an independent per-token float64 loop."""

from dataclasses import replace

import pytest
import torch
from megamoe_torch import MegaMoE, MegaMoEConfig

MIXTRAL = dict(hidden_size=32, intermediate_size=48, num_experts=8, top_k=2)
QWEN3 = dict(hidden_size=32, intermediate_size=24, num_experts=16, top_k=4)
QWEN2_SHARED = dict(
    QWEN3,
    renormalize=False,
    num_shared_experts=1,
    shared_intermediate_size=40,
    shared_expert_gate=True,
)
DSV3 = dict(
    hidden_size=32,
    intermediate_size=16,
    num_experts=16,
    top_k=4,
    scoring="sigmoid",
    num_groups=4,
    top_groups=2,
    routed_scaling_factor=2.5,
    use_correction_bias=True,
    num_shared_experts=1,
)


def per_token_float64(layer: MegaMoE, x_TH: torch.Tensor) -> torch.Tensor:
    """Routes and computes every token on its own, in float64, straight from the parameters."""
    c = layer.config
    gate = layer.gate.weight.double()
    w13, w2 = layer.w13.double(), layer.w2.double()
    out = []
    for x in x_TH.double():
        logits = gate @ x
        if c.scoring == "softmax":
            scores = torch.softmax(logits, 0)
            choice = scores
        else:
            scores = torch.sigmoid(logits)
            choice = scores + layer.e_score_correction_bias.double()
        if c.num_groups > 1:
            per_group = c.num_experts // c.num_groups
            group_score = [
                sorted(choice[g * per_group : (g + 1) * per_group].tolist())[-2:]
                for g in range(c.num_groups)
            ]
            kept = sorted(range(c.num_groups), key=lambda g: -sum(group_score[g]))[: c.top_groups]
            choice = torch.tensor(
                [
                    choice[e].item() if e // per_group in kept else float("-inf")
                    for e in range(c.num_experts)
                ],
                dtype=torch.float64,
            )
        chosen = sorted(range(c.num_experts), key=lambda e: -choice[e].item())[: c.top_k]
        weights = scores[chosen]
        if c.renormalize:
            weights = weights / weights.sum()
        weights = weights * c.routed_scaling_factor
        y = torch.zeros_like(x)
        for expert, weight in zip(chosen, weights, strict=True):
            gate_up = w13[expert] @ x
            gate_part, up_part = gate_up[: c.intermediate_size], gate_up[c.intermediate_size :]
            y += weight * (w2[expert] @ (torch.nn.functional.silu(gate_part) * up_part))
        if layer.shared_experts is not None:
            shared = layer.shared_experts.double()
            s = shared.down_proj(torch.nn.functional.silu(shared.gate_proj(x)) * shared.up_proj(x))
            if shared.gate is not None:
                s = torch.sigmoid(shared.gate(x)) * s
            layer.shared_experts.float()
            y += s
        out.append(y)
    return torch.stack(out) if out else x_TH.double().new_zeros(x_TH.shape)


def layer_route(layer, x):
    from megamoe_runtime.routing import route

    return route(layer.router_logits(x), layer.config.router)


def make_layer(fields, **overrides):
    torch.manual_seed(0)
    layer = MegaMoE(MegaMoEConfig(**fields, **overrides))
    if layer.e_score_correction_bias is not None:
        layer.e_score_correction_bias.normal_(0, 0.1)
    return layer


@pytest.mark.parametrize(
    "fields", [MIXTRAL, QWEN3, QWEN2_SHARED, DSV3], ids=["mixtral", "qwen3", "qwen2-shared", "dsv3"]
)
def test_layer_matches_per_token_float64_loop(fields):
    layer = make_layer(fields)
    x = torch.randn(29, fields["hidden_size"])
    expected = per_token_float64(layer, x)
    actual = layer(x)
    error = (actual.double() - expected).norm() / expected.norm()
    assert error < 1e-6, error


def test_any_leading_shape_returns_same_shape_and_dtype():
    layer = make_layer(QWEN3)
    x = torch.randn(2, 3, 5, 32)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.reshape(-1, 32), layer(x.reshape(-1, 32)))


def test_edge_cases_zero_tokens_top_k_equals_experts_and_one_expert():
    layer = make_layer(QWEN3)
    assert layer(torch.randn(0, 32)).shape == (0, 32)
    every = make_layer(dict(QWEN3, num_experts=4, top_k=4))
    x = torch.randn(7, 32)
    torch.testing.assert_close(every(x).double(), per_token_float64(every, x), rtol=1e-5, atol=1e-6)
    single = make_layer(dict(QWEN3, num_experts=1, top_k=1))
    torch.testing.assert_close(
        single(x).double(), per_token_float64(single, x), rtol=1e-5, atol=1e-6
    )


def test_one_expert_taking_every_token_and_empty_experts():
    layer = make_layer(MIXTRAL)
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[3, 0] = 4.0
        layer.gate.weight[5, 0] = 2.0
    # x[:, 0] > 0: experts 3 and 5 take every token, the six others receive no rows
    x = torch.randn(13, 32)
    x[:, 0] = x[:, 0].abs().clamp(max=2.0) + 1.0
    batch, _ = layer.dispatcher.dispatch(x, *layer_route(layer, x))
    assert batch.expert_offsets.tolist() == [0, 0, 0, 0, 13, 13, 26, 26, 26]
    torch.testing.assert_close(layer(x).double(), per_token_float64(layer, x), rtol=1e-5, atol=1e-6)


def test_returns_router_logits_when_asked():
    layer = make_layer(MIXTRAL)
    x = torch.randn(4, 32)
    _, logits = layer(x, return_router_logits=True)
    assert logits.shape == (4, 8)
    torch.testing.assert_close(logits, x @ layer.gate.weight.t())


def test_bad_input_is_refused():
    layer = make_layer(QWEN3)
    with pytest.raises(ValueError, match="hidden_size=32"):
        layer(torch.randn(3, 31))
    with pytest.raises(TypeError, match="torch.float64"):
        layer(torch.randn(3, 32, dtype=torch.float64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer([[0.0] * 32])
    with pytest.raises(ValueError, match="x holds NaN"):
        make_layer(QWEN3, check_inputs=True)(torch.full((2, 32), float("nan")))
    layer = make_layer(QWEN3)
    with pytest.raises(KeyError, match="lacks 'w2'"):
        layer.load_full_state_dict({k: v for k, v in layer.state_dict().items() if k != "w2"})
    with pytest.raises(ValueError, match="backend"):
        MegaMoEConfig(**QWEN3, backend="triton")
    with pytest.raises(ValueError, match="cannot run on cpu"):
        MegaMoE(MegaMoEConfig(**QWEN3, backend="grouped_mm"))(torch.randn(2, 32))
    with pytest.raises(ValueError, match="top_k"):
        MegaMoEConfig(**dict(QWEN3, top_k=17))
    with pytest.raises(ValueError, match="eager_graph_tokens must be an int >= 0, got -1"):
        MegaMoEConfig(**QWEN3, eager_graph_tokens=-1)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn])
def test_a_layer_of_a_dtype_that_is_not_an_activation_dtype_is_refused(dtype):
    with pytest.raises(TypeError, match=f"16 bits or more, .* got {dtype}"):
        MegaMoE(MegaMoEConfig(**QWEN3), dtype=dtype)


def test_expert_weights_load_from_float_tensors_only():
    layer = make_layer(QWEN3)
    w2 = layer.w2.detach().clone()
    w13 = layer.w13.detach().clone()
    with pytest.raises(TypeError, match="w2 must hold floating-point values, got torch.int64"):
        layer.load_expert_weights(w13=torch.zeros(w13.shape), w2=torch.ones(w2.shape).long())
    with pytest.raises(TypeError, match="w13 must be a torch.Tensor, got list"):
        layer.load_expert_weights(w13=[[1.0]])
    assert torch.equal(layer.w13, w13) and torch.equal(layer.w2, w2)  # nothing was written


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        (dict(hidden_size=32.5), TypeError, "hidden_size must be an int >= 1, got 32.5"),
        (dict(hidden_size="32"), TypeError, "hidden_size must be an int >= 1, got '32'"),
        (dict(top_k=True), TypeError, "top_k must be an int >= 1, got True"),
        (dict(num_experts=0), ValueError, "num_experts must be an int >= 1, got 0"),
        (dict(capacity=-3), ValueError, "capacity must be an int >= 0 or None, got -3"),
        (dict(capacity=8.0), TypeError, "capacity must be an int >= 0 or None, got 8.0"),
        (
            dict(num_shared_experts=1, shared_intermediate_size=0),
            ValueError,
            "shared_intermediate_size must be an int >= 1 or None, got 0",
        ),
        (dict(max_tokens_per_rank=0), ValueError, "max_tokens_per_rank must be an int >= 1"),
    ],
)
def test_integer_fields_take_ints_in_range_and_say_which_field_and_what_they_accept(
    fields, error, message
):
    with pytest.raises(error, match=message):
        MegaMoEConfig(**{**QWEN3, **fields})


def test_static_capacity_overflow_is_refused():
    layer = make_layer(QWEN3, capacity=8)
    layer(torch.randn(2, 32))
    with pytest.raises(ValueError, match="capacity 8"):
        layer(torch.randn(3, 32))


def test_auto_backend_says_which_and_why():
    layer = make_layer(QWEN3)
    assert layer.backend == "reference"
    assert "auto: reference" in layer.backend_reason


def test_weights_changed_in_place_are_picked_up():
    layer = make_layer(QWEN3)
    x = torch.randn(5, 32)
    before = layer(x)
    with torch.no_grad():
        layer.w2.mul_(2.0)
    torch.testing.assert_close(layer(x), 2.0 * before)


def test_gradients_flow_through_the_reference_backend():
    layer = make_layer(QWEN3)
    x = torch.randn(6, 32, requires_grad=True)
    layer(x).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert layer.w13.grad is not None and layer.w13.grad.abs().sum() > 0
    assert layer.gate.weight.grad is not None


@torch.no_grad()
def test_shared_experts_the_batch_cannot_hold_say_why():
    """shared_experts_path="batch" names what keeps the shared experts out of the batch; a
    device without the fused path runs them as their own MLP."""
    # a gated shared MLP (Qwen2-MoE) joins the batch: its gate weighs the shared pairs
    gated = MegaMoEConfig(
        **dict(QWEN2_SHARED, shared_intermediate_size=48), shared_experts_path="batch"
    )
    assert gated.shared_experts_in_batch_problems == ()
    with pytest.raises(ValueError, match="40 is not a multiple of intermediate_size=24"):
        MegaMoEConfig(**QWEN2_SHARED, shared_experts_path="batch")
    with pytest.raises(ValueError, match="shared_experts_path must be one of"):
        MegaMoEConfig(**DSV3, shared_experts_path="beside")
    # a CPU has no fused path: the shared experts run as their own MLP
    x = torch.randn(3, DSV3["hidden_size"])
    auto = MegaMoE(MegaMoEConfig(**DSV3), dtype=torch.float32)
    explicit = MegaMoE(MegaMoEConfig(**DSV3, shared_experts_path="batch"), dtype=torch.float32)
    explicit.load_state_dict(auto.state_dict())
    for layer in (auto, explicit):
        assert layer._shared_batch_experts() == 0 and layer._shared_experts_in_batch(3) == 0
    assert torch.equal(explicit(x), auto(x))


@torch.no_grad()
def test_a_backend_switch_frees_the_prepared_weights_before_preparing_anew(monkeypatch):
    """The prepared expert weights (the backend's copy: tens of GB at DeepSeek-V3's size) are
    held by the layer's cache alone, the routed experts' view of weights prepared with the
    shared ones included: a backend switch frees them before the next preparation (the view
    kept them alive, and `megamoe demo` ran an 80 GB GPU out of memory at dsv3)."""
    import weakref

    layer = MegaMoE(MegaMoEConfig(**DSV3, shared_experts_path="batch"), dtype=torch.float32)
    # as on a GPU's fused path: the shared expert prepared as a 17th expert of the routed ones
    monkeypatch.setattr(layer, "_shared_batch_experts", lambda: 1)
    layer._resolve_backend()
    whole = layer._prepared_weights(shared_in_batch=True)
    routed = layer._prepared_weights()
    assert whole.w13_E2IH.shape[0] == 17 and routed.w13_E2IH.shape[0] == 16
    assert routed.w13_E2IH.data_ptr() == whole.w13_E2IH.data_ptr()  # a view, no copy
    old = weakref.ref(whole.w13_E2IH)
    del whole, routed
    layer.use_backend("reference")
    layer._resolve_backend()
    prepare = layer._expert_backend.prepare

    def checked_prepare(pack):
        assert old() is None, "the weights prepared before the switch are still held"
        return prepare(pack)

    monkeypatch.setattr(layer._expert_backend, "prepare", checked_prepare)
    assert layer._prepared_weights().w13_E2IH.shape[0] == 16


@torch.no_grad()
def test_weights_prepared_with_the_shared_experts_hold_the_routed_ones_once(monkeypatch):
    """The weights a batch with the shared experts computes on copy the routed experts' (the
    shared MLP appended as more experts): w13 and w2 become views of that copy where it holds
    them as they are, and their own storage is freed; the outputs, the state dict and a later
    update in place are as before, and the next call prepares nothing."""
    layer = MegaMoE(MegaMoEConfig(**DSV3, shared_experts_path="batch"), dtype=torch.float32)
    x = torch.randn(5, DSV3["hidden_size"])
    expected, state = layer(x), {k: v.clone() for k, v in layer.state_dict().items()}
    # as on a GPU's fused path: the shared expert prepared as a 17th expert of the routed ones
    monkeypatch.setattr(layer, "_shared_batch_experts", lambda: 1)
    storages = [layer.w13.untyped_storage(), layer.w2.untyped_storage()]
    whole = layer._prepared_weights(shared_in_batch=True)  # the reference backend's pack
    assert layer.w13.data_ptr() == whole.w13_E2IH.data_ptr()
    assert layer.w2.data_ptr() == whole.w2_EHI.data_ptr()
    # the parameters' own storage: held by these handles alone
    assert [torch._C._storage_Use_Count(storage._cdata) for storage in storages] == [1, 1]
    assert layer.w13.shape == (16, 32, 32) and isinstance(layer.w13, torch.nn.Parameter)
    for name, value in layer.state_dict().items():
        assert torch.equal(value, state[name]), name
    prepare = layer._expert_backend.prepare
    calls = []
    monkeypatch.setattr(
        layer._expert_backend, "prepare", lambda pack: calls.append(1) or prepare(pack)
    )
    assert layer._prepared_weights(shared_in_batch=True) is whole and not calls
    monkeypatch.undo()
    assert torch.equal(layer(x), expected)
    layer.w2.mul_(0.5)  # in place: prepared again, the parameter a view of the new weights
    monkeypatch.setattr(layer, "_shared_batch_experts", lambda: 1)
    again = layer._prepared_weights(shared_in_batch=True)
    assert again is not whole and layer.w2.data_ptr() == again.w2_EHI.data_ptr()
    assert torch.equal(again.w2_EHI[:16], state["w2"] * 0.5)


@torch.no_grad()
def test_weights_prepared_in_another_order_leave_the_parameters_their_own(monkeypatch):
    """A prepared copy of the routed experts that differs from w13 in one expert (its last: the
    comparison runs an expert at a time, not on the first alone) is not taken for w13: the
    parameter keeps its storage and values; w2, held as it is, becomes a view."""
    from dataclasses import replace

    layer = MegaMoE(MegaMoEConfig(**DSV3, shared_experts_path="batch"), dtype=torch.float32)
    w13 = layer.w13.clone()
    assert layer.backend == "reference"  # resolved: its prepare is the one wrapped below
    monkeypatch.setattr(layer, "_shared_batch_experts", lambda: 1)
    prepare = layer._expert_backend.prepare

    def reordered(pack):
        prepared = prepare(pack)
        w13_E2IH = prepared.w13_E2IH.clone()
        w13_E2IH[15] = w13_E2IH[15].flip(0)  # the gate and up rows of one expert in turn
        return replace(prepared, w13_E2IH=w13_E2IH)

    monkeypatch.setattr(layer._expert_backend, "prepare", reordered)
    whole = layer._prepared_weights(shared_in_batch=True)
    assert layer.w13.data_ptr() != whole.w13_E2IH.data_ptr()
    assert torch.equal(layer.w13, w13)
    assert layer.w2.data_ptr() == whole.w2_EHI.data_ptr()


@torch.no_grad()
def test_a_dropped_layer_is_freed_by_its_last_reference():
    """No reference cycle holds a layer (its captured graphs included): what it owns is freed
    when the last reference goes, never by the cycle collector at a random moment, such as in
    the middle of another CUDA-graph capture, which destroying a graph would invalidate."""
    import gc
    import weakref

    enabled = gc.isenabled()
    gc.disable()
    try:
        for fields in (QWEN3, DSV3):
            layer = MegaMoE(MegaMoEConfig(**fields), dtype=torch.float32)
            layer(torch.randn(3, fields["hidden_size"]))
            alive = weakref.ref(layer)
            del layer
            assert alive() is None
    finally:
        if enabled:
            gc.enable()


@torch.no_grad()
def test_atomic_combine_where_it_cannot_run_is_the_ordered_combine():
    """atomic_combine is the cutedsl down GEMM's: on a CPU (the torch path, the reference
    backend) the layer combines in its fixed order, the bits of atomic_combine=False."""
    with pytest.raises(TypeError, match="atomic_combine must be a bool, got 1"):
        MegaMoEConfig(**QWEN3, atomic_combine=1)
    atomic = make_layer(QWEN3, atomic_combine=True)
    ordered = MegaMoE(replace(atomic.config, atomic_combine=False))
    ordered.load_state_dict(atomic.state_dict())
    x = torch.randn(5, 32)
    assert torch.equal(atomic(x), ordered(x))
    assert not atomic._combines_atomically()
