"""Which of megamoe's computations a probed block's parts match: its routing, its router's
matmul dtype, its experts' layout and SwiGLU variant, its shared experts.

Shape legend: T probe tokens, H hidden size, E experts, K experts per token, I intermediate size.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import replace
from typing import Any

import torch
from megamoe_kernels import GEGLU, SwiGLU
from megamoe_kernels.reference import expert_mlp_reference
from megamoe_runtime.routing import RouterConfig, route, weights_of_chosen
from torch import nn

from megamoe_torch.hf.families import UnsupportedBlockError
from megamoe_torch.hf.fp8 import activation_dtype_of, model_config_of
from megamoe_torch.hf.naming import (
    SHARED_PROJECTIONS,
    megamoe_experts_from_hf,
    megamoe_gate_up_bias_from_hf,
)
from megamoe_torch.hf.probes import (
    MATCH_TOLERANCE,
    BlockRun,
    ProbeRandom,
    Routed,
    clear_forward_hooks,
    random_copy,
    relative_error,
    worst_token_error,
)
from megamoe_torch.hf.structure import BlockParts
from megamoe_torch.layer import OutputNorm

# attribute names under which routers and blocks keep the grouped top-k sizes
GROUP_COUNT_ATTRIBUTES = ("n_group", "num_group", "num_expert_group", "num_groups", "n_groups")
KEPT_GROUP_ATTRIBUTES = ("topk_group", "num_topk_group", "top_groups", "topk_groups")
# attribute names of the SwiGLU variants' constants
LIMIT_ATTRIBUTES = ("limit", "swiglu_limit", "clamp_limit")
ALPHA_ATTRIBUTES = ("alpha", "swiglu_alpha")
# an attribute naming a softcap c (c * tanh(v / c)), on the experts or any module inside them
SOFTCAP_ATTRIBUTE = "softcap"
# an output norm's epsilon
OUTPUT_NORM_EPS_ATTRIBUTES = ("variance_epsilon", "eps")
# the attribute under which a sparsemixer router (PhiMoE) keeps its epsilon
SPARSEMIXER_EPS_ATTRIBUTES = ("router_jitter_noise",)


def _routing_candidates(
    parts: BlockParts, top_k: int, *, has_bias: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    """(the RouterConfig fields worth matching, why the block's own group sizes cannot be
    expressed, if they cannot)."""
    group_count = _number_attribute((parts.router, parts.block), GROUP_COUNT_ATTRIBUTES)
    kept_groups = _number_attribute((parts.router, parts.block), KEPT_GROUP_ATTRIBUTES)
    groupings: list[dict[str, Any]] = [dict(num_groups=1, top_groups=1)]
    if group_count and kept_groups and group_count > 1 and parts.num_experts % group_count == 0:
        for group_score, dropped in itertools.product(("top2_sum", "max"), (-math.inf, 0.0)):
            groupings.append(
                dict(
                    num_groups=group_count,
                    top_groups=kept_groups,
                    group_score=group_score,
                    dropped_group_score=dropped,
                )
            )
    # where the correction bias is added for the choice: to the scores (None: no bias, or the
    # scores) or to the logits (Kolibri)
    biases = [(True, False), (True, True), (False, False)] if has_bias else [(False, False)]
    candidates, refusals = [], []
    for (use_bias, on_logits), scoring, renormalize, grouping in itertools.product(
        biases, ("softmax", "sigmoid", "sqrtsoftplus"), (True, False), groupings
    ):
        fields = dict(
            num_experts=parts.num_experts,
            top_k=top_k,
            scoring=scoring,
            renormalize=renormalize,
            use_correction_bias=use_bias,
            **grouping,
        )
        if on_logits:
            fields["choice_on_logits"] = True
        try:
            RouterConfig(**fields)
        except ValueError as error:
            if str(error) not in refusals:
                refusals.append(str(error))
            continue
        candidates.append(fields)
    eps = _number_attribute((parts.router, parts.block), SPARSEMIXER_EPS_ATTRIBUTES, int | float)
    if eps is not None and top_k == 2 and not has_bias:
        for renormalize in (False, True):
            candidates.append(
                dict(
                    num_experts=parts.num_experts,
                    top_k=top_k,
                    scoring="sparsemixer",
                    renormalize=renormalize,
                    use_correction_bias=False,
                    sparsemixer_eps=float(eps),
                )
            )
    return candidates, refusals


def _number_attribute(holders: tuple, names: tuple[str, ...], kind=int) -> int | float | None:
    """The first attribute of `names` on the first of `holders` holding one that is of `kind`
    (a bool is not a number here), or None."""
    for holder in holders:
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, kind) and not isinstance(value, bool):
                return value
    return None


def match_routing(
    parts: BlockParts, runs: list[BlockRun], seen_routings: list[Routed]
) -> tuple[dict[str, Any], float]:
    """The RouterConfig fields (and the weights' scale) that give the recorded routing: the same
    experts for every token, weighted in one ratio (identity experts, whose pairs a block
    hands its experts with weight 0, compare by their tokens' other experts; their weights show
    in the block's output, `identity_weights`)."""
    top_k = seen_routings[0].ids_TK.shape[1]
    if parts.naming.routing_table is not None:
        return _match_table_routing(parts, runs, seen_routings, top_k)
    has_bias = runs[0].correction_bias_E is not None
    nearest = (-1, None)
    routed_experts = parts.routed_experts
    candidates, refusals = _routing_candidates(parts, top_k, has_bias=has_bias)
    for fields in candidates:
        config = RouterConfig(**fields)
        scales, matching_tokens = [], 0
        for run, seen in zip(runs, seen_routings, strict=True):
            ids_TK, weights_TK = _route_probe(run, config)
            expected_ids, order = _routed_first(
                ids_TK.long(), parts, routed=ids_TK < routed_experts
            )
            expected_weights = weights_TK.gather(1, order)
            # a block hands its experts an identity expert's pair with weight 0 (LongCat-Flash)
            seen_routed = seen.weights_TK != 0 if parts.num_identity_experts else None
            seen_ids, seen_order = _routed_first(seen.ids_TK, parts, routed=seen_routed)
            same_TK = (seen_ids == expected_ids).all(dim=-1)
            matching_tokens += int(same_TK.sum())
            if not bool(same_TK.all()):
                scales = None
                continue
            if scales is not None:
                ratio = seen.weights_TK.gather(1, seen_order) / expected_weights
                scales.append(ratio[expected_ids < routed_experts])
        if matching_tokens > nearest[0]:
            nearest = (matching_tokens, fields)
        if not scales:
            continue
        ratio = torch.cat([r.reshape(-1) for r in scales])
        scale = float(ratio.mean())
        if scale > 0 and float((ratio - scale).abs().max()) <= 1e-4 * scale:
            return fields, scale
    if refusals:
        raise UnsupportedBlockError(
            f"the block routes by grouped top-k with sizes megamoe cannot express: {refusals[0]}"
        )
    total = sum(r.ids_TK.shape[0] for r in seen_routings)
    count, fields = nearest
    if fields is None:
        closest = ""
    elif count == total:
        closest = (
            f"; {_describe_routing(fields)} picks the same experts for every probe token but "
            "the block weights them otherwise"
        )
    else:
        closest = (
            f"; the nearest, {_describe_routing(fields)}, picks the same experts for {count} of "
            f"{total} probe tokens"
        )
    raise UnsupportedBlockError(
        "the router's choice or weights match none of megamoe's routings (softmax, sigmoid or "
        "sqrt(softplus) scores, renormalised or not, correction bias, grouped top-k, scaling; "
        f"PhiMoE's sparsemixer){closest}"
    )


def _match_table_routing(
    parts: BlockParts, runs: list[BlockRun], seen_routings: list[Routed], top_k: int
) -> tuple[dict[str, Any], float]:
    """match_routing for a block whose router looks each token's experts up in a table by its
    token id (DeepSeek-V4's hash layers): the experts must be the rows of the probe's table, and
    their weights the scores of one scoring, renormalised or not, in one ratio."""
    for run, seen in zip(runs, seen_routings, strict=True):
        expected_ids = run.routing_table[run.input_ids_T].long().sort(dim=-1).values
        if not torch.equal(seen.ids_TK.sort(dim=-1).values, expected_ids):
            raise UnsupportedBlockError(
                f"the router holds a routing table ({parts.naming.routing_table}) but the "
                "experts it picks are not the table's rows of the token ids"
            )
    for scoring, renormalize in itertools.product(
        ("softmax", "sigmoid", "sqrtsoftplus"), (True, False)
    ):
        fields = dict(
            num_experts=parts.num_experts,
            top_k=top_k,
            scoring=scoring,
            renormalize=renormalize,
            use_correction_bias=False,
        )
        config = RouterConfig(**fields)
        ratios = []
        for run, seen in zip(runs, seen_routings, strict=True):
            seen_order = seen.ids_TK.sort(dim=-1).indices
            ids_TK = run.routing_table[run.input_ids_T].long()
            order = ids_TK.sort(dim=-1).indices
            expected = weights_of_chosen(run.logits_TE, ids_TK, config).gather(1, order)
            ratios.append(seen.weights_TK.gather(1, seen_order) / expected)
        ratio = torch.cat([r.reshape(-1) for r in ratios])
        scale = float(ratio.mean())
        if scale > 0 and float((ratio - scale).abs().max()) <= 1e-4 * scale:
            return dict(fields, routing_table_vocab_size=parts.routing_table_vocab_size), scale
    raise UnsupportedBlockError(
        "the router picks each token's experts from its routing table but weighs them by none "
        "of megamoe's scorings (softmax, sigmoid or sqrt(softplus) scores of the chosen "
        "experts, renormalised or not, scaled)"
    )


def _route_probe(run: BlockRun, config: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """megamoe's routing `config` of a probe's logits, with its correction bias if it takes one."""
    return route(
        run.logits_TE,
        config,
        correction_bias_E=run.correction_bias_E if config.use_correction_bias else None,
    )


def _routed_first(
    ids_TK: torch.Tensor, parts: BlockParts, *, routed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's ids sorted, the order): with `routed` (a mask of its pairs to the routed
    experts), the routed ones first and every other pair as id E + Z, so two routings compare
    by their routed experts."""
    if routed is not None:
        ids_TK = torch.where(routed, ids_TK.long(), parts.num_experts)
    return ids_TK.long().sort(dim=-1)


def identity_weights(
    fields: dict[str, Any], parts: BlockParts, run: BlockRun
) -> torch.Tensor | None:
    """float32 [T, 1]: each probe token's weights of identity experts under the matched
    routing `fields` (None without identity experts)."""
    if not parts.num_identity_experts:
        return None
    ids_TK, weights_TK = _route_probe(run, RouterConfig(**fields))
    return torch.where(ids_TK >= parts.routed_experts, weights_TK, 0.0).sum(-1, keepdim=True)


def _describe_routing(fields: dict[str, Any]) -> str:
    words = [fields["scoring"], "renormalised" if fields["renormalize"] else "not renormalised"]
    if fields["use_correction_bias"]:
        on = "logits" if fields.get("choice_on_logits") else "scores"
        words.append(f"with the correction bias on the {on}")
    if fields.get("num_groups", 1) > 1:
        words.append(f"{fields['num_groups']} groups")
    if fields["scoring"] == "sparsemixer":
        words.append(f"eps {fields['sparsemixer_eps']:g}")
    return " ".join(words)


def read_router_dtype(parts: BlockParts, run: BlockRun, logits_index: int) -> tuple[str, bool]:
    """("float32" or "input", whether the logits come out fp32) of the router on bf16 tokens.

    The router's tensors are bf16 where a bf16 model holds them so (fp32 tensors next to bf16
    experts stay fp32); a router whose forward then fails (it casts the tokens, not its weight,
    to fp32) is run again with its tensors as they are.
    """
    args, kwargs, _ = run.router_calls[0]
    # the model's dtype: the experts', or for e4m3 experts, which do not show it, the config's
    router_weight = parts.router.state_dict()[
        parts.naming.router_weight[len(parts.router_name) + 1 :]
    ]
    model_dtype = activation_dtype_of(
        expert_dtype=parts.expert_weight.dtype,
        model_config=model_config_of(parts.block),
        router_dtype=router_weight.dtype,
    )
    originals = dict(parts.router.state_dict(keep_vars=True))
    hidden = parts.hidden_size

    def bf16(value):
        if (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value.shape[-1] == hidden
        ):
            return value.to(torch.bfloat16)
        return value

    failure = None
    for cast_tensors in (True, False):
        twin = copy.deepcopy(run.router_twin)
        clear_forward_hooks(twin)
        for name, tensor in list(twin.state_dict(keep_vars=True).items()):
            keep_fp32 = originals[name].dtype == torch.float32 and model_dtype != torch.float32
            if cast_tensors and tensor.is_floating_point() and not keep_fp32:
                tensor.data = tensor.data.to(torch.bfloat16)
        try:
            with torch.no_grad():
                output = twin(*map(bf16, args), **{k: bf16(v) for k, v in kwargs.items()})
            break
        except Exception as error:  # the router's own code on tensors it did not expect
            failure = error
    else:
        raise UnsupportedBlockError(
            f"the router's forward failed on bf16 tokens ({type(failure).__name__}: {failure})"
        )
    logits = output[logits_index] if isinstance(output, (tuple, list)) else output
    x_TH = run.x_TH.to(torch.bfloat16).float()
    weights = dict(twin.named_parameters())
    weight_key = parts.naming.router_weight[len(parts.router_name) + 1 :]
    exact_TE = x_TH @ weights[weight_key].float().t()
    if parts.naming.router_bias is not None:
        exact_TE = (
            exact_TE + weights[parts.naming.router_bias[len(parts.router_name) + 1 :]].float()
        )
    error = relative_error(logits.float().reshape(exact_TE.shape), exact_TE)
    return ("float32" if error < 1e-6 else "input"), logits.dtype == torch.float32


def read_experts_math(parts: BlockParts, random: ProbeRandom, *, weights_on_input: bool) -> dict:
    """The expert layout and SwiGLU variant (as naming and config fields) the experts compute,
    from a copy of the experts module holding two random experts."""
    experts, naming = parts.experts, parts.naming
    num_experts, hidden = parts.routed_experts, parts.expert_hidden_size
    probe_experts = 2
    tensors = experts.state_dict(keep_vars=True)
    stand_ins = {}
    for name, tensor in tensors.items():
        # stacked [E, ...] or flattened [E * I, H]: the first rows of two experts
        rows = tensor.shape[0] // num_experts if tensor.shape[0] % num_experts == 0 else 0
        if rows == 0:
            raise UnsupportedBlockError(f"the experts hold experts.{name}, which is not per-expert")
        shape = (probe_experts, *tensor.shape[1:]) if rows == 1 else (probe_experts * rows, hidden)
        fan_in = tensor.shape[-1] if tensor.dim() >= 2 else hidden
        stand_ins[id(tensor)] = random.normal(*shape, std=1.0 / math.sqrt(fan_in))
    twin = random_copy(experts, random, replace=stand_ins)
    _eager_experts(twin)
    for module in twin.modules():  # the experts' own count, where they keep it
        for name, value in list(vars(module).items()):
            if isinstance(value, int) and not isinstance(value, bool) and value == num_experts:
                setattr(module, name, probe_experts)
    tokens = 16
    x_TH = _tokens_of_magnitudes(random, tokens, hidden)
    expert_of_token = torch.arange(tokens) % probe_experts
    weights_T1 = random.uniform(tokens, 1, low=0.5, high=1.5)
    try:
        with torch.no_grad():
            if weights_on_input:
                rows = torch.zeros(probe_experts, tokens, hidden)
                rows[expert_of_token, torch.arange(tokens)] = x_TH
                out = twin(rows.reshape(-1, hidden)).view(probe_experts, tokens, hidden)
                seen_TH = out[expert_of_token, torch.arange(tokens)]
            else:
                seen_TH = twin(x_TH, expert_of_token.unsqueeze(-1), weights_T1)
    except Exception as error:
        raise UnsupportedBlockError(
            f"the experts' forward failed when probed ({type(error).__name__}: {error})"
        ) from error
    twin_tensors = {
        f"experts.{name}": tensor for name, tensor in twin.state_dict(keep_vars=True).items()
    }
    limits = {None} | set(_float_attributes(experts, LIMIT_ATTRIBUTES))
    alphas = {1.0} | set(_float_attributes(experts, ALPHA_ATTRIBUTES))
    softcaps = sorted({None} | _softcaps(experts), key=lambda v: -1 if v is None else v)
    # the sigmoid's (alpha, cubic term): a SiLU-gated MLP's alphas, or the tanh GELU's (GeGLU)
    gate_factors = [(alpha, 0.0) for alpha in sorted(alphas)]
    gate_factors.append((GEGLU.alpha, GEGLU.gate_cubic))
    # (activation, swiglu limit, (alpha, cubic), up offset, gate softcap, up softcap): ungated
    # experts compute relu^2 alone
    activations = (
        [("relu2", None, (1.0, 0.0), 0.0, None, None)]
        if naming.experts_ungated
        else itertools.product(
            ("swiglu",),
            sorted(limits, key=lambda v: -1 if v is None else v),
            gate_factors,
            (0.0, 1.0),
            softcaps,
            softcaps,
        )
    )
    for layout, (
        activation,
        limit,
        (alpha, cubic),
        up_offset,
        gate_softcap,
        up_softcap,
    ) in itertools.product(_expert_layouts(parts, twin_tensors), list(activations)):
        candidate = replace(naming, **layout)
        w13, w2 = megamoe_experts_from_hf(candidate, twin_tensors, num_experts=probe_experts)
        gate_up_bias = down_bias = None
        if naming.gate_up_bias is not None:
            gate_up_bias = megamoe_gate_up_bias_from_hf(
                candidate, twin_tensors[naming.gate_up_bias]
            )
            down_bias = twin_tensors[naming.down_bias]
        swiglu = SwiGLU(
            limit=limit,
            alpha=alpha,
            up_offset=up_offset,
            gate_softcap=gate_softcap,
            up_softcap=up_softcap,
            gate_cubic=cubic,
        )
        expected_TH = _expert_math(
            x_TH,
            expert_of_token,
            w13,
            w2,
            gate_up_bias,
            down_bias,
            swiglu=swiglu,
            activation=activation,
        )
        if not weights_on_input:
            expected_TH = expected_TH * weights_T1
        if worst_token_error(seen_TH.float().reshape(expected_TH.shape), expected_TH) < (
            MATCH_TOLERANCE
        ):
            # the swiglu_* fields of MegaMoEConfig
            return dict(**layout, **swiglu.kernel_constants(), activation=activation)
    act_fn = getattr(experts, "act_fn", None)
    named = "" if act_fn is None else f" (act_fn {type(act_fn).__name__})"
    if naming.experts_ungated:
        raise UnsupportedBlockError(
            f"the ungated experts compute something other than relu(up x)^2{named}, the "
            "ungated experts megamoe computes"
        )
    raise UnsupportedBlockError(
        f"the experts compute something other than a SiLU- or GELU-gated MLP{named}: megamoe "
        "computes silu(gate) * up (SwiGLU), optionally clamped with alpha and (up + 1) or "
        "softcapped, or gelu_tanh(gate) * up (GeGLU), with or without biases"
    )


def _tokens_of_magnitudes(random: ProbeRandom, tokens: int, hidden: int) -> torch.Tensor:
    """[tokens, hidden] random probe tokens, in turn 0.25, 1, 4 and 16 times the unit normal's
    size: a clamp or a softcap of the activation shows on the large ones."""
    magnitudes = torch.tensor([0.25, 1.0, 4.0, 16.0]).repeat(tokens // 4).unsqueeze(-1)
    return random.normal(tokens, hidden) * magnitudes


def _eager_experts(twin: nn.Module) -> None:
    """The probe copy of the experts runs their own (eager) forward, the definition of what
    they compute, whichever implementation the model runs them with: transformers' FP8 experts
    hand their weights to FP8 kernels (grouped_mm, DeepGEMM), which take no fp32 probe copies,
    and experts the model runs with megamoe's implementation would read themselves again."""
    config = getattr(twin, "config", None)
    if getattr(config, "_experts_implementation", None) not in (None, "eager"):
        config._experts_implementation = "eager"


def _expert_layouts(parts: BlockParts, tensors: dict[str, torch.Tensor]) -> list[dict]:
    """The BlockNaming layout fields the experts' tensor shapes allow (both, where 2I = H)."""
    if parts.naming.flattened_gate_and_up is not None:
        return [{}]
    hidden, intermediate = parts.expert_hidden_size, parts.intermediate_size
    ungated = parts.naming.experts_ungated
    first_rows = intermediate if ungated else 2 * intermediate
    shapes = (
        tuple(tensors[parts.naming.gate_up].shape[1:]),
        tuple(tensors[parts.naming.down].shape[1:]),
    )
    return [
        dict(experts_transposed=transposed, gate_up_interleaved=interleaved)
        for transposed in (False, True)
        for interleaved in ((False,) if ungated else (False, True))
        if shapes
        == (
            ((hidden, first_rows), (intermediate, hidden))
            if transposed
            else ((first_rows, hidden), (hidden, intermediate))
        )
    ]


def _expert_math(
    x_TH, expert_of_token, w13, w2, gate_up_bias, down_bias, *, swiglu, activation
) -> torch.Tensor:
    """The reference expert MLP of each token's one expert, in the tokens' order."""
    order = torch.argsort(expert_of_token, stable=True)
    counts = torch.bincount(expert_of_token, minlength=w13.shape[0])
    expert_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    out_TH = expert_mlp_reference(
        x_TH[order],
        expert_offsets,
        w13,
        w2,
        w13_bias_E2I=gate_up_bias,
        w2_bias_EH=down_bias,
        **swiglu.constants(),
        activation=activation,
    )
    return out_TH[torch.argsort(order)]


def _softcaps(experts: nn.Module) -> set[float]:
    """The softcaps the experts' modules name (Inkling2's activation holds one for the gate and
    one for up): candidates for either cap."""
    return {
        float(value)
        for module in experts.modules()
        for name, value in vars(module).items()
        if SOFTCAP_ATTRIBUTE in name
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and 0 < value < math.inf
    }


def _float_attributes(module: nn.Module, names: tuple[str, ...]) -> list[float]:
    values = []
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            values.append(float(value))
    return values


def read_shared_experts(
    parts: BlockParts, random: ProbeRandom, *, routed_swiglu: SwiGLU, activation: str
) -> dict[str, Any]:
    """The shared experts' MegaMoEConfig fields: a bias-free MLP of gate_proj, up_proj and
    down_proj Linears (or one gate_up_proj of gate rows then up rows, and down_proj), computing
    silu(gate) * up or the routed experts' SwiGLU (`routed_swiglu`), as a probe shows; next to
    ungated experts (`activation` "relu2"), an ungated up_proj and down_proj computing
    relu(up x)^2."""
    shared = parts.shared
    if shared is None:
        return {}
    if activation == "relu2":
        names: tuple[str, ...] = ("up_proj", "down_proj")
    elif parts.naming.shared_gate_up:
        names = ("gate_up_proj", "down_proj")
    else:
        names = SHARED_PROJECTIONS
    projections = [getattr(shared, name, None) for name in names]
    if not all(isinstance(p, nn.Linear) and p.bias is None for p in projections) or any(
        True for key in shared.state_dict() if key.split(".")[0] not in names
    ):
        holds = sorted(shared.state_dict())
        expected = (
            "an ungated MLP of Linears up_proj and down_proj, as the routed experts are"
            if activation == "relu2"
            else "a MLP of Linears gate_proj, up_proj and down_proj (or gate_up_proj and down_proj)"
        )
        raise UnsupportedBlockError(
            f"the shared experts ({type(shared).__name__}, holding {holds}) are not {expected}, "
            "bias-free: the shared experts megamoe computes"
        )
    intermediate = projections[-1].in_features
    if intermediate == 0:  # DeepSeek-V3 with n_shared_experts=0
        return {}
    fields = dict(
        num_shared_experts=1,
        shared_intermediate_size=intermediate,
        shared_expert_gate=parts.shared_gate is not None,
    )
    twin = random_copy(shared, random)
    x_TH = _tokens_of_magnitudes(random, 16, parts.hidden_size)
    with torch.no_grad():
        seen = twin(x_TH)
        if activation == "relu2":
            expected = twin.down_proj(torch.relu(twin.up_proj(x_TH)).square())
            if relative_error(seen, expected) <= MATCH_TOLERANCE:
                return fields
            raise UnsupportedBlockError(
                "the ungated shared experts compute something other than relu(up x)^2 (act_fn "
                f"{type(getattr(shared, 'act_fn', None)).__name__})"
            )
        if parts.naming.shared_gate_up:
            gate, up = twin.gate_up_proj(x_TH).chunk(2, dim=-1)
        else:
            gate, up = twin.gate_proj(x_TH), twin.up_proj(x_TH)
        candidates = {"silu": SwiGLU(), "routed": routed_swiglu}
        for name, swiglu in candidates.items():
            if relative_error(seen, twin.down_proj(swiglu(gate, up))) <= MATCH_TOLERANCE:
                return dict(fields, shared_swiglu=name)
    act_fn = type(getattr(shared, "act_fn", None)).__name__
    raise UnsupportedBlockError(
        f"the shared experts compute something other than silu(gate) * up or the routed "
        f"experts' SwiGLU (act_fn {act_fn})"
    )


def read_output_norm(parts: BlockParts, random: ProbeRandom) -> dict[str, Any]:
    """The output norm's MegaMoEConfig field: its eps, where a copy of the norm computes
    MegaMoE's OutputNorm (an RMSNorm) with it; {} for a block without one."""
    norm = parts.output_norm
    if norm is None:
        return {}
    eps = _float_attributes(norm, OUTPUT_NORM_EPS_ATTRIBUTES)
    twin = random_copy(norm, random)
    y_TH = random.normal(8, parts.hidden_size, std=3.0)
    with torch.no_grad():
        seen = twin(y_TH)
        if eps:
            expected = OutputNorm(parts.hidden_size, eps[0])
            expected.weight.copy_(twin.weight)
            if relative_error(seen, expected(y_TH)) <= MATCH_TOLERANCE:
                return {"output_norm_eps": eps[0]}
    raise UnsupportedBlockError(
        f"the output norm ({type(norm).__name__}) computes something other than the RMSNorm "
        "megamoe computes, y * rsqrt(mean(y^2) + eps) * weight"
        + ("" if eps else f", or holds its eps in none of {OUTPUT_NORM_EPS_ATTRIBUTES}")
    )


def snapped_scale(scale: float, parts: BlockParts) -> float:
    """A measured scale, snapped to 1 or to a scaling attribute of the router or the block when
    it is one of them up to rounding."""
    named = [
        float(value)
        for holder in (parts.router, parts.block)
        for name, value in vars(holder).items()
        if "scal" in name and isinstance(value, (int, float)) and not isinstance(value, bool)
    ]
    for candidate in (1.0, *named):
        if candidate > 0 and abs(scale - candidate) <= 1e-4 * candidate:
            return candidate
    return scale
