"""Pure-torch oracles for every kernel: fp32 accumulation, any device, no CuTe DSL.

Shape legend: M rows of an expert batch (its capacity), E experts, H hidden size,
I intermediate size. An expert batch is sorted expert-major and packed tight: expert e owns rows
[expert_offsets[e], expert_offsets[e + 1]); rows past expert_offsets[E] are not data. With
`expert_counts` (the masked layout: a fixed stride per expert, as a low-latency receive buffer
holds it) expert e owns rows [expert_offsets[e], expert_offsets[e] + expert_counts[e]) and the
rest of its stride is not data.

The oracles read `expert_offsets` (and `expert_counts`) on the host (a sync), which is fine for
an oracle and is why they are never on a hot path. Rows that are not data are never read and
come back as zeros.
"""

from __future__ import annotations

import torch


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    limit: float | None = None,
    alpha: float = 1.0,
    up_offset: float = 0.0,
    gate_softcap: float | None = None,
    up_softcap: float | None = None,
    gate_cubic: float = 0.0,
) -> torch.Tensor:
    """gate * sigmoid(alpha * (gate + gate_cubic * gate^3)) * (up + up_offset), computed in fp32.

    The defaults give silu(gate) * up. `limit` clamps gate to at most `limit` and up to
    [-limit, limit] first; gpt-oss computes limit=7.0, alpha=1.702, up_offset=1.0.
    `gate_softcap` c replaces the linear gate factor (not the sigmoid's gate) by
    c * tanh(gate / c), and `up_softcap` c up by c * tanh(up / c) (Inkling2's softcapped SwiGLU).
    alpha = 2 sqrt(2 / pi) and gate_cubic = 0.044715 make the gate factor the tanh GELU
    (megamoe_kernels.GEGLU: Gemma 4's experts).
    """
    gate, up = gate.float(), up.float()
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    linear_gate = gate
    if gate_softcap is not None:
        linear_gate = gate_softcap * torch.tanh(gate / gate_softcap)
    if up_softcap is not None:
        up = up_softcap * torch.tanh(up / up_softcap)
    sigmoid_gate = gate if gate_cubic == 0.0 else gate + gate_cubic * gate**3
    return linear_gate * torch.sigmoid(alpha * sigmoid_gate) * (up + up_offset)


def _expert_row_ranges(
    expert_offsets: torch.Tensor, expert_counts: torch.Tensor | None = None
) -> list[tuple[int, int, int]]:
    """(expert, first row, row end) of every expert with rows: tight, or masked by
    `expert_counts` (each expert's rows from its start on)."""
    offsets = expert_offsets.tolist()
    experts = len(offsets) - 1
    if expert_counts is None:
        ends = offsets[1:]
    else:
        counts = expert_counts.tolist()
        if len(counts) != experts:
            raise ValueError(
                f"expert_counts has {len(counts)} entries for {experts} experts (expert_offsets "
                f"has {experts + 1})"
            )
        ends = [start + count for start, count in zip(offsets, counts, strict=False)]
        for expert, (count, start, next_start) in enumerate(
            zip(counts, offsets, offsets[1:], strict=False)
        ):
            if not 0 <= count <= next_start - start:
                raise ValueError(
                    f"expert_counts[{expert}] = {count} must lie in [0, {next_start - start}] "
                    f"(the expert's stride)"
                )
    return [
        (expert, offsets[expert], ends[expert])
        for expert in range(experts)
        if ends[expert] > offsets[expert]
    ]


def gate_up_swiglu_reference(
    rows_MH: torch.Tensor,
    expert_offsets: torch.Tensor,
    w13_E2IH: torch.Tensor,
    *,
    w13_bias_E2I: torch.Tensor | None = None,
    limit: float | None = None,
    alpha: float = 1.0,
    up_offset: float = 0.0,
    gate_softcap: float | None = None,
    up_softcap: float | None = None,
    gate_cubic: float = 0.0,
    expert_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """swiglu(x Wg^T + bg, x Wu^T + bu) per expert; `w13_E2IH` holds gate rows [0, I) then up rows
    [I, 2I), `w13_bias_E2I` (optional) their biases in the same order. `limit`, `alpha`,
    `up_offset`, `gate_softcap`, `up_softcap`, `gate_cubic`: see `swiglu`; `expert_counts`: the
    masked layout (module docstring)."""
    intermediate = w13_E2IH.shape[1] // 2
    out_MI = torch.zeros(rows_MH.shape[0], intermediate, dtype=torch.float32, device=rows_MH.device)
    for expert, start, end in _expert_row_ranges(expert_offsets, expert_counts):
        gate_up = rows_MH[start:end].float() @ w13_E2IH[expert].float().t()
        if w13_bias_E2I is not None:
            gate_up = gate_up + w13_bias_E2I[expert].float()
        out_MI[start:end] = swiglu(
            gate_up[:, :intermediate],
            gate_up[:, intermediate:],
            limit=limit,
            alpha=alpha,
            up_offset=up_offset,
            gate_softcap=gate_softcap,
            up_softcap=up_softcap,
            gate_cubic=gate_cubic,
        )
    return out_MI


def up_relu2_reference(
    rows_MH: torch.Tensor,
    expert_offsets: torch.Tensor,
    w1_EIH: torch.Tensor,
    *,
    w1_bias_EI: torch.Tensor | None = None,
    expert_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """relu(x Wu^T + bu)^2 per expert: ungated experts (Nemotron-H), `w1_EIH` their up
    projections; `expert_counts`: the masked layout (module docstring)."""
    out_MI = torch.zeros(
        rows_MH.shape[0], w1_EIH.shape[1], dtype=torch.float32, device=rows_MH.device
    )
    for expert, start, end in _expert_row_ranges(expert_offsets, expert_counts):
        up = rows_MH[start:end].float() @ w1_EIH[expert].float().t()
        if w1_bias_EI is not None:
            up = up + w1_bias_EI[expert].float()
        out_MI[start:end] = torch.relu(up).square()
    return out_MI


def down_reference(
    hidden_MI: torch.Tensor,
    expert_offsets: torch.Tensor,
    w2_EHI: torch.Tensor,
    row_scale_M: torch.Tensor | None = None,
    *,
    w2_bias_EH: torch.Tensor | None = None,
    expert_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W2^T (+ b2) per expert, each row optionally multiplied by `row_scale_M` (its routing
    weight); `expert_counts`: the masked layout (module docstring)."""
    out_MH = torch.zeros(
        hidden_MI.shape[0], w2_EHI.shape[1], dtype=torch.float32, device=hidden_MI.device
    )
    for expert, start, end in _expert_row_ranges(expert_offsets, expert_counts):
        out_MH[start:end] = hidden_MI[start:end].float() @ w2_EHI[expert].float().t()
        if w2_bias_EH is not None:
            out_MH[start:end] += w2_bias_EH[expert].float()
        if row_scale_M is not None:
            out_MH[start:end] *= row_scale_M[start:end].float().unsqueeze(-1)
    return out_MH


def expert_mlp_reference(
    rows_MH: torch.Tensor,
    expert_offsets: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    row_scale_M: torch.Tensor | None = None,
    *,
    round_intermediate_to: torch.dtype | None = None,
    w13_bias_E2I: torch.Tensor | None = None,
    w2_bias_EH: torch.Tensor | None = None,
    limit: float | None = None,
    alpha: float = 1.0,
    up_offset: float = 0.0,
    gate_softcap: float | None = None,
    up_softcap: float | None = None,
    gate_cubic: float = 0.0,
    expert_counts: torch.Tensor | None = None,
    activation: str = "swiglu",
) -> torch.Tensor:
    """The whole expert MLP, fp32 throughout.

    `round_intermediate_to` rounds the SwiGLU output to a dtype before the down GEMM, as a kernel
    that stores the intermediate in bf16 does; None keeps it in fp32 (the exact oracle).
    `w13_bias_E2I` / `w2_bias_EH`: per-expert biases of the two projections; `limit`, `alpha`,
    `up_offset`, `gate_softcap`, `up_softcap`, `gate_cubic`: the SwiGLU variant (see `swiglu`);
    `expert_counts`: the masked layout (module docstring); `activation="relu2"`: ungated experts
    (`up_relu2_reference`), `w13_E2IH` and its bias their up projections alone, [E, I, H] and
    [E, I].
    """
    if activation == "relu2":
        hidden_MI = up_relu2_reference(
            rows_MH,
            expert_offsets,
            w13_E2IH,
            w1_bias_EI=w13_bias_E2I,
            expert_counts=expert_counts,
        )
    elif activation == "swiglu":
        hidden_MI = gate_up_swiglu_reference(
            rows_MH,
            expert_offsets,
            w13_E2IH,
            w13_bias_E2I=w13_bias_E2I,
            limit=limit,
            alpha=alpha,
            up_offset=up_offset,
            gate_softcap=gate_softcap,
            up_softcap=up_softcap,
            gate_cubic=gate_cubic,
            expert_counts=expert_counts,
        )
    else:
        raise ValueError(f"activation must be 'swiglu' or 'relu2', got {activation!r}")
    if round_intermediate_to is not None:
        hidden_MI = hidden_MI.to(round_intermediate_to)
    return down_reference(
        hidden_MI,
        expert_offsets,
        w2_EHI,
        row_scale_M,
        w2_bias_EH=w2_bias_EH,
        expert_counts=expert_counts,
    )


def relative_l2_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; NaN anywhere gives NaN (passes no bound)."""
    actual64 = actual.detach().double()
    expected64 = expected.detach().double()
    denominator = expected64.norm()
    if denominator == 0:
        return float((actual64 - expected64).norm())
    return float((actual64 - expected64).norm() / denominator)


def fp8_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """DeepGEMM's accuracy measure of FP8 GEMMs, 1 - 2 sum(xy) / sum(x^2 + y^2), in float64:
    0 for equal tensors, about rel-L2^2 / 2 for small errors."""
    x, y = actual.detach().double(), expected.detach().double()
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)
