"""Weight packs: the FP8 pack's checks, quantize/dequantize, and the backends that take it on a
CPU (the reference oracle on the dequantized values)."""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels.reference import expert_mlp_reference, relative_l2_error
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts import make_backend
from megamoe_runtime.weights import Prequantized, Unquantized, dequantize, quantize

E, H, INTER = 4, 256, 384


def random_pack(seed: int = 0) -> Unquantized:
    generator = torch.Generator().manual_seed(seed)
    return Unquantized(
        w13_E2IH=torch.randn(E, 2 * INTER, H, generator=generator) / H**0.5,
        w2_EHI=torch.randn(E, H, INTER, generator=generator) / INTER**0.5,
    )


def test_quantize_gives_e4m3_blocks_whose_dequantized_values_are_near_the_source():
    source = random_pack()
    pack = quantize(source)
    assert pack.w13_E2IH.dtype == torch.float8_e4m3fn
    assert pack.w13_scales.shape == (E, 6, 2) and pack.w2_scales.shape == (E, 2, 3)
    restored = dequantize(pack)
    assert restored.w13_E2IH.dtype == torch.float32
    assert relative_l2_error(restored.w13_E2IH, source.w13_E2IH) < 0.05
    assert relative_l2_error(restored.w2_EHI, source.w2_EHI) < 0.05
    # deterministic
    again = quantize(source)
    assert torch.equal(again.w2_EHI.view(torch.uint8), pack.w2_EHI.view(torch.uint8))


def test_the_reference_backend_computes_an_fp8_pack_on_its_dequantized_values():
    pack = quantize(random_pack(1))
    counts = torch.tensor([3, 0, 5, 2])
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    rows = torch.randn(int(counts.sum()), H)
    batch = ExpertBatch(rows_MH=rows, expert_offsets=offsets)
    backend = make_backend("reference")
    out = backend(batch, backend.prepare(pack))
    exact = dequantize(pack)
    assert torch.equal(out, expert_mlp_reference(rows, offsets, exact.w13_E2IH, exact.w2_EHI))


def test_an_fp8_pack_refuses_other_dtypes_and_misshaped_scales():
    pack = quantize(random_pack(2))
    with pytest.raises(TypeError, match="w13_E2IH must be torch.float8_e4m3fn"):
        Prequantized(
            w13_E2IH=pack.w13_E2IH.float(),
            w13_scales=pack.w13_scales,
            w2_EHI=pack.w2_EHI,
            w2_scales=pack.w2_scales,
        )
    with pytest.raises(ValueError, match=r"w2_scales must be float32 \[4, 2, 3\]"):
        Prequantized(
            w13_E2IH=pack.w13_E2IH,
            w13_scales=pack.w13_scales,
            w2_EHI=pack.w2_EHI,
            w2_scales=pack.w2_scales[:, :, :2],
        )
    with pytest.raises(ValueError, match="w2 must have shape"):
        Prequantized(
            w13_E2IH=pack.w13_E2IH,
            w13_scales=pack.w13_scales,
            w2_EHI=pack.w2_EHI[:, :, :128],
            w2_scales=pack.w2_scales,
        )


def test_a_full_precision_pack_refuses_integer_and_e4m3_weights():
    pack = random_pack(2)
    for dtype in (torch.int32, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match=f"full-precision floating point, .* got {dtype}"):
            Unquantized(w13_E2IH=pack.w13_E2IH.to(dtype), w2_EHI=pack.w2_EHI.to(dtype))


def test_dense_experts_appended_to_a_pack_sum_to_the_dense_mlp():
    """with_dense_experts: a dense SwiGLU MLP of intermediate 3 x INTER as experts E .. E + 2; a
    token's rows in those three experts, summed, are the MLP of the token (the oracle computes in
    fp32: only the summation order differs); the routed experts are unchanged, and first_experts
    gives back views of them."""
    from megamoe_runtime.experts import first_experts
    from megamoe_runtime.weights import with_dense_experts

    generator = torch.Generator().manual_seed(3)
    pack = random_pack(3)
    dense = 3 * INTER
    gate_FH, up_FH = (torch.randn(dense, H, generator=generator) / H**0.5 for _ in "gu")
    down_HF = torch.randn(H, dense, generator=generator) / dense**0.5
    joined = with_dense_experts(pack, gate_FH=gate_FH, up_FH=up_FH, down_HF=down_HF)
    assert joined.num_experts == E + 3
    assert torch.equal(joined.w13_E2IH[:E], pack.w13_E2IH)
    assert torch.equal(joined.w2_EHI[:E], pack.w2_EHI)
    tokens = torch.randn(5, H, generator=generator)
    # each token in every dense expert: rows [E x 0 rows..., 5 rows for each dense expert]
    offsets = torch.tensor([0] * (E + 1) + [5, 10, 15], dtype=torch.int32)
    batch_rows = tokens.repeat(3, 1)
    out = expert_mlp_reference(batch_rows, offsets, joined.w13_E2IH, joined.w2_EHI)
    summed = out.view(3, 5, H).sum(0)
    mlp = (torch.nn.functional.silu(tokens @ gate_FH.T) * (tokens @ up_FH.T)) @ down_HF.T
    assert relative_l2_error(summed, mlp) < 1e-5
    routed = first_experts(joined, E)
    assert routed.num_experts == E and routed.w13_E2IH.data_ptr() == joined.w13_E2IH.data_ptr()


def test_dense_experts_refuse_what_they_cannot_join():
    from megamoe_runtime.weights import with_dense_experts

    pack = random_pack(4)
    gate = torch.randn(2 * INTER, H)
    with pytest.raises(ValueError, match="down must have shape"):
        with_dense_experts(pack, gate_FH=gate, up_FH=gate, down_HF=torch.randn(H, INTER))
    odd = torch.randn(INTER + 8, H)
    with pytest.raises(ValueError, match="not a multiple"):
        with_dense_experts(pack, gate_FH=odd, up_FH=odd, down_HF=torch.randn(H, INTER + 8))
    biased = Unquantized(w13_E2IH=pack.w13_E2IH, w2_EHI=pack.w2_EHI, w2_bias_EH=torch.zeros(E, H))
    with pytest.raises(ValueError, match="bias-free"):
        with_dense_experts(biased, gate_FH=gate, up_FH=gate, down_HF=torch.randn(H, 2 * INTER))


def ungated_pack(seed: int = 5) -> Unquantized:
    generator = torch.Generator().manual_seed(seed)
    return Unquantized(
        w13_E2IH=torch.randn(E, INTER, H, generator=generator) / H**0.5,
        w2_EHI=torch.randn(E, H, INTER, generator=generator) / INTER**0.5,
        w13_bias_E2I=torch.randn(E, INTER, generator=generator),
        activation="relu2",
    )


def test_the_reference_backend_computes_ungated_relu2_experts():
    pack = ungated_pack()
    assert pack.intermediate_size == INTER and "ungated relu^2 experts" in pack.expert_math
    counts = torch.tensor([3, 0, 5, 2])
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    rows = torch.randn(int(counts.sum()), H)
    backend = make_backend("reference")
    out = backend(ExpertBatch(rows_MH=rows, expert_offsets=offsets), backend.prepare(pack))
    expert_of_row = torch.repeat_interleave(torch.arange(E), counts)
    expected = torch.stack(
        [
            pack.w2_EHI[e] @ torch.relu(pack.w13_E2IH[e] @ row + pack.w13_bias_E2I[e]).square()
            for e, row in zip(expert_of_row.tolist(), rows, strict=True)
        ]
    )
    assert relative_l2_error(out, expected) < 1e-6


def test_an_ungated_pack_checks_its_shapes_and_is_not_quantized():
    pack = ungated_pack()
    with pytest.raises(ValueError, match=r"w2 must have shape \(4, 256, 768\)"):
        Unquantized(w13_E2IH=pack.w13_E2IH.repeat(1, 2, 1), w2_EHI=pack.w2_EHI, activation="relu2")
    with pytest.raises(ValueError, match="activation must be one of"):
        Unquantized(w13_E2IH=pack.w13_E2IH, w2_EHI=pack.w2_EHI, activation="gelu")
    with pytest.raises(
        ValueError, match=r"ungated relu\^2 experts, which the FP8 kernels are not built for"
    ):
        quantize(pack)


def test_a_slice_of_an_fp8_pack_holds_its_experts_tensors_as_views():
    from megamoe_runtime.experts import expert_slice

    pack = quantize(random_pack(6))
    part = expert_slice(pack, 1, 3)
    assert type(part) is Prequantized and part.swiglu == pack.swiglu and part.num_experts == 2
    assert part.w13_E2IH.data_ptr() == pack.w13_E2IH[1].data_ptr()
    assert torch.equal(part.w2_scales, pack.w2_scales[1:3])


def test_fp8_dense_experts_are_the_dense_mlps_e4m3_blocks_as_they_are():
    """An FP8 pack with an e4m3 dense MLP (as an FP8 checkpoint's shared experts: e4m3 weights
    and one float32 scale per 128 x 128 block) appended: dequantized, it is the full-precision
    pack with the dequantized MLP appended, bit for bit (each expert takes its rows of blocks
    as they are); and what it cannot hold is refused."""
    from megamoe_kernels import dequantize_weight_blocks, quantize_weight_blocks
    from megamoe_runtime.weights import dequantize, quantize, with_dense_experts

    experts, hidden, inter = 3, 200, 256  # hidden off the 128 grid, two blocks per expert
    generator = torch.Generator().manual_seed(5)
    pack = quantize(
        Unquantized(
            w13_E2IH=torch.randn(experts, 2 * inter, hidden, generator=generator),
            w2_EHI=torch.randn(experts, hidden, inter, generator=generator),
        )
    )
    dense = 2 * inter  # two experts of the MLP
    gate, gate_scales = quantize_weight_blocks(torch.randn(1, dense, hidden, generator=generator))
    up, up_scales = quantize_weight_blocks(torch.randn(1, dense, hidden, generator=generator))
    down, down_scales = quantize_weight_blocks(torch.randn(1, hidden, dense, generator=generator))
    scales = (gate_scales[0], up_scales[0], down_scales[0])

    joined = with_dense_experts(pack, gate_FH=gate[0], up_FH=up[0], down_HF=down[0], scales=scales)

    assert isinstance(joined, Prequantized) and joined.num_experts == experts + 2
    expected = with_dense_experts(
        dequantize(pack),
        gate_FH=dequantize_weight_blocks(gate, gate_scales)[0],
        up_FH=dequantize_weight_blocks(up, up_scales)[0],
        down_HF=dequantize_weight_blocks(down, down_scales)[0],
    )
    values = dequantize(joined)
    assert torch.equal(values.w13_E2IH, expected.w13_E2IH)
    assert torch.equal(values.w2_EHI, expected.w2_EHI)

    with pytest.raises(ValueError, match="with their block scales"):
        with_dense_experts(pack, gate_FH=gate[0], up_FH=up[0], down_HF=down[0])
    with pytest.raises(ValueError, match="the down scales must be float32"):
        with_dense_experts(
            pack, gate_FH=gate[0], up_FH=up[0], down_HF=down[0], scales=scales[:2] + scales[:1]
        )
    narrow = quantize(
        Unquantized(
            w13_E2IH=torch.randn(experts, 2 * 192, hidden, generator=generator),
            w2_EHI=torch.randn(experts, hidden, 192, generator=generator),
        )
    )
    with pytest.raises(ValueError, match="multiple of 128"):
        with_dense_experts(
            narrow,
            gate_FH=gate[0][:384],
            up_FH=up[0][:384],
            down_HF=down[0][:, :384],
            scales=(gate_scales[0][:3], up_scales[0][:3], down_scales[0][:, :3]),
        )
    with pytest.raises(ValueError, match="come with an FP8"):
        with_dense_experts(
            dequantize(pack),
            gate_FH=gate[0].float(),
            up_FH=up[0].float(),
            down_HF=down[0].float(),
            scales=scales,
        )
