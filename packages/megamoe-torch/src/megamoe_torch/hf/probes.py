"""Probes of a transformers MoE block: copies of its modules run on random inputs, recording
what each part is given and answers.

Shape legend: T probe tokens, H hidden size, E experts, K experts per token.

No probe touches the block or its weights: each runs a copy whose tensors are random fp32 CPU
tensors of the same shapes (random values show what zeros or equal values would hide), with the
block's forward hooks left out.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megamoe_torch.hf.families import UnsupportedBlockError
from megamoe_torch.hf.structure import LATENT_NAMES, SHARED_GATE_NAME, BlockParts

_PROBE_BATCH, _PROBE_SEQUENCE = 2, 12
_PROBE_VOCAB = 1000  # the token ids given to a block that takes them and holds no table
MATCH_TOLERANCE = 1e-5  # relative L2, fp32 against fp32
FORWARD_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)


# the probes


class ProbeRandom:
    """Random fp32 CPU tensors from one seeded generator: the same probe, the same numbers."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator) * std + mean

    def uniform(self, *shape: int, low: float, high: float) -> torch.Tensor:
        return torch.rand(*shape, generator=self.generator) * (high - low) + low

    def integers(self, *shape: int, high: int) -> torch.Tensor:
        """int64 values in [0, high)."""
        return torch.randint(high, shape, generator=self.generator)

    def distinct(self, rows: int, count: int, *, high: int) -> torch.Tensor:
        """int64 [rows, count]: each row `count` distinct values of [0, high)."""
        return torch.rand(rows, high, generator=self.generator).argsort(dim=1)[:, :count]


def random_copy(
    module: nn.Module, random: ProbeRandom, *, replace: dict[int, torch.Tensor] | None = None
) -> nn.Module:
    """A deep copy of `module` on the CPU in fp32 whose tensors are random (or `replace`'s, by
    id of the tensor they stand for), without forward hooks; `module` is untouched."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if replace is not None and id(tensor) in replace:
            value = replace[id(tensor)]
        elif tensor.is_floating_point():
            fan_in = tensor.shape[-1] if tensor.dim() >= 2 else 1
            value = random.normal(*tensor.shape, std=1.0 / math.sqrt(fan_in))
        else:
            value = cpu_copy(tensor)
        memo[id(tensor)] = (
            nn.Parameter(value, requires_grad=False) if isinstance(tensor, nn.Parameter) else value
        )
    twin = copy.deepcopy(module, memo)
    clear_forward_hooks(twin)
    return twin.eval()


def cpu_copy(tensor: torch.Tensor, *, float32: bool = False) -> torch.Tensor:
    """A CPU copy of `tensor` (floating point ones in fp32 if `float32`); zeros for a tensor on
    the meta device, whose values are unknown (a block read from a config alone)."""
    dtype = torch.float32 if float32 and tensor.is_floating_point() else tensor.dtype
    if tensor.device.type == "meta":
        return torch.zeros(tensor.shape, dtype=dtype)
    return tensor.detach().to("cpu", dtype, copy=True)


def clear_forward_hooks(module: nn.Module) -> None:
    for submodule in module.modules():
        for registry in FORWARD_HOOKS:
            setattr(submodule, registry, type(getattr(submodule, registry))())


def _shallow_stand_in(module: nn.Module, forward) -> nn.Module:
    """A shallow copy of `module` of a subclass whose forward is `forward`: attributes the
    block may read stay, the computation is replaced."""
    stand_in = copy.copy(module)
    stand_in.__class__ = type(
        f"{type(module).__name__}ProbeStandIn", (type(module),), {"forward": forward}
    )
    stand_in._modules = dict(module._modules)
    stand_in._parameters = dict(module._parameters)
    stand_in._buffers = dict(module._buffers)
    for registry in FORWARD_HOOKS:
        setattr(stand_in, registry, type(getattr(module, registry))())
    stand_in.calls = []
    return stand_in


@dataclass
class BlockRun:
    """One probe of the block: what it was given, what its parts saw and answered."""

    x_TH: torch.Tensor
    logits_TE: torch.Tensor
    correction_bias_E: torch.Tensor | None
    output: Any
    expert_calls: list
    expert_outputs: list
    shared_calls: list
    shared_output_TH: torch.Tensor | None
    shared_gate_TH: torch.Tensor | None  # sigmoid of the gate, [T, 1]
    router_calls: list
    router_twin: nn.Module
    # the token ids the block was given (where it takes them) and its routing table's stand-in
    input_ids_T: torch.Tensor | None = None
    routing_table: torch.Tensor | None = None


def run_block(
    block: nn.Module, parts: BlockParts, random: ProbeRandom, *, bias_mean: float
) -> BlockRun:
    """Runs a copy of `block` whose router (random weights), experts (a recorder) and shared
    experts (a fixed random answer) are stand-ins, on random fp32 tokens."""
    hidden, num_experts = parts.hidden_size, parts.num_experts
    bias_tensor = None
    if parts.naming.correction_bias is not None:
        bias_tensor = block.state_dict(keep_vars=True)[parts.naming.correction_bias]
    bias_value = random.normal(num_experts, std=0.3, mean=bias_mean)
    stand_ins = {}
    if bias_tensor is not None:
        stand_ins[id(bias_tensor)] = bias_value.reshape(bias_tensor.shape).clone()
    table = None
    if parts.naming.routing_table is not None:
        # each token id's experts, distinct and random (a zero table would route every token
        # alike); the token ids the block is given, random
        held = block.state_dict(keep_vars=True)[parts.naming.routing_table]
        table = random.distinct(held.shape[0], held.shape[1], high=num_experts).to(held.dtype)
        stand_ins[id(held)] = table
    router_twin = random_copy(parts.router, random, replace=stand_ins)
    router_weight = router_twin.state_dict()[
        parts.naming.router_weight[len(parts.router_name) + 1 :]
    ]
    router_weight.mul_(3.0)  # decisive routing: logits of a few units
    router_calls: list = []
    router_twin.register_forward_hook(
        lambda module, args, kwargs, output: router_calls.append((args, kwargs, output)),
        with_kwargs=True,
    )
    expert_outputs: list = []

    def record_experts(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        hidden_states = args[0] if args else next(iter(kwargs.values()))
        answer = random.normal(*hidden_states.shape)
        expert_outputs.append(answer)
        return answer.to(hidden_states.dtype)

    experts_recorder = _shallow_stand_in(parts.experts, record_experts)
    shared_answer: list = []

    def answer_shared(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        hidden_states = args[0] if args else next(iter(kwargs.values()))
        answer = random.normal(*hidden_states.shape)
        shared_answer.append(answer)
        return answer.clone()

    modules = {parts.router_name: router_twin, "experts": experts_recorder}
    if parts.latent:
        # the routing and how the parts combine, read as a block without latent projections:
        # the experts' recorder sees the tokens and answers in their width (the projections
        # themselves are bias-free Linears the layer applies as they are)
        for name in LATENT_NAMES:
            modules[name] = nn.Identity()
    if parts.output_norm_name is not None:
        # the routing and how the parts combine, read as a block without its output norm
        # (read_output_norm reads the norm itself)
        modules[parts.output_norm_name] = nn.Identity()
    shared_stub = None
    if parts.shared is not None:
        shared_stub = _shallow_stand_in(parts.shared, answer_shared)
        modules[parts.shared_name] = shared_stub
    gate_twin = None
    if parts.shared_gate is not None:
        gate_twin = random_copy(parts.shared_gate, random)
        modules[SHARED_GATE_NAME] = gate_twin
    twin = copy.copy(block)
    twin._modules = {
        # the stand-ins, and random copies of the other children (only those: a copy of the
        # experts module would be as large as the model's experts, in fp32)
        name: modules[name] if name in modules else child and random_copy(child, random)
        for name, child in block._modules.items()
    }
    twin._parameters = {
        name: None
        if p is None
        else nn.Parameter(stand_ins.get(id(p), random.normal(*p.shape)), requires_grad=False)
        for name, p in block._parameters.items()
    }
    twin._buffers = {
        name: None if b is None else stand_ins.get(id(b), cpu_copy(b, float32=True))
        for name, b in block._buffers.items()
    }
    for registry in FORWARD_HOOKS:
        setattr(twin, registry, type(getattr(block, registry))())
    twin.training = False
    x_BSH = random.normal(_PROBE_BATCH, _PROBE_SEQUENCE, hidden)
    inputs = {}
    if "input_ids" in parts.inputs:
        vocab = parts.routing_table_vocab_size or _PROBE_VOCAB
        inputs["input_ids"] = random.integers(_PROBE_BATCH, _PROBE_SEQUENCE, high=vocab)
    try:
        with torch.no_grad():
            output = twin(x_BSH, **inputs)
    except Exception as error:  # the block's code on a structure it did not expect
        raise UnsupportedBlockError(
            f"the block's forward failed when probed ({type(error).__name__}: {error})"
        ) from error
    x_TH = x_BSH.reshape(-1, hidden)
    linear = dict(router_twin.named_parameters())
    weight_key = parts.naming.router_weight[len(parts.router_name) + 1 :]
    bias_key = (
        None
        if parts.naming.router_bias is None
        else parts.naming.router_bias[len(parts.router_name) + 1 :]
    )
    logits_TE = nn.functional.linear(
        x_TH, linear[weight_key], None if bias_key is None else linear[bias_key]
    )
    return BlockRun(
        x_TH=x_TH,
        logits_TE=logits_TE,
        correction_bias_E=None if bias_tensor is None else bias_value,
        output=output,
        expert_calls=experts_recorder.calls,
        expert_outputs=expert_outputs,
        shared_calls=[] if shared_stub is None else shared_stub.calls,
        shared_output_TH=shared_answer[0].reshape(x_TH.shape) if shared_answer else None,
        shared_gate_TH=None
        if gate_twin is None
        else torch.sigmoid(nn.functional.linear(x_TH, gate_twin.weight)),
        router_calls=router_calls,
        router_twin=router_twin,
        input_ids_T=inputs["input_ids"].reshape(-1) if inputs else None,
        routing_table=table,
    )


@dataclass(frozen=True)
class Routed:
    """What a probe's experts were given: the routing, and the routed part of the output."""

    ids_TK: torch.Tensor
    weights_TK: torch.Tensor
    routed_TH: torch.Tensor
    weights_on_input: bool


def routed_of(run: BlockRun, parts: BlockParts) -> Routed:
    if len(run.expert_calls) != 1:
        raise UnsupportedBlockError(
            f"the block calls its experts {len(run.expert_calls)} times per forward, not once"
        )
    args, kwargs = run.expert_calls[0]
    given = [*args, *kwargs.values()]
    tensors = [t for t in given if isinstance(t, torch.Tensor)]
    tokens, hidden = run.x_TH.shape
    if len(tensors) == 3:
        ids = [t for t in tensors if not t.is_floating_point()]
        floats = [t for t in tensors if t.is_floating_point()]
        # the tokens, flat [T, H] or in the block's input shape (DBRX)
        rows = [t for t in floats if t.shape[-1] == hidden and t.numel() == tokens * hidden]
        if len(ids) == 1 and len(rows) >= 1:
            rows_TH = rows[0].reshape(tokens, hidden)
            weights = [t for t in floats if t is not rows[0] and t.shape == ids[0].shape]
            if len(weights) == 1 and ids[0].shape[0] == tokens:
                if not torch.allclose(rows_TH.float(), run.x_TH, rtol=1e-6, atol=0.0):
                    raise UnsupportedBlockError(
                        "the block changes the hidden states before its experts see them"
                    )
                return Routed(
                    ids_TK=ids[0].long(),
                    weights_TK=weights[0].float(),
                    routed_TH=run.expert_outputs[0].reshape(tokens, hidden),
                    weights_on_input=False,
                )
    experts = parts.routed_experts
    if len(tensors) == 1 and tuple(tensors[0].shape) == (experts * tokens, hidden):
        # every expert computes on each token times its routing weight (0 where not chosen)
        rows_ETH = tensors[0].float().view(experts, tokens, hidden)
        scale_ET = (rows_ETH * run.x_TH).sum(-1) / (run.x_TH * run.x_TH).sum(-1)
        if not torch.allclose(rows_ETH, scale_ET.unsqueeze(-1) * run.x_TH, rtol=1e-5, atol=1e-6):
            raise UnsupportedBlockError(
                "the block gives its experts something other than weighted copies of the tokens"
            )
        chosen_TE = scale_ET.t() != 0
        per_token = chosen_TE.sum(-1)
        if per_token.min() != per_token.max() or int(per_token[0]) == 0:
            raise UnsupportedBlockError("the block does not route each token to k experts")
        top_k = int(per_token[0])
        ids_TK = chosen_TE.float().topk(top_k, dim=-1).indices.sort(dim=-1).values
        routed_TH = run.expert_outputs[0].view(experts, tokens, hidden).sum(0)
        return Routed(
            ids_TK=ids_TK,
            weights_TK=scale_ET.t().gather(1, ids_TK),
            routed_TH=routed_TH,
            weights_on_input=True,
        )
    described = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in given]
    raise UnsupportedBlockError(
        f"the block calls its experts with {described}, not (hidden states, top-k ids, top-k "
        "weights) or the weighted token copies of every expert"
    )


def router_logits_position(run: BlockRun) -> tuple[int | None, int]:
    """(index of the logits among the router's outputs, how many outputs it has)."""
    if not run.router_calls:
        raise UnsupportedBlockError("the block's forward does not call its router")
    output = run.router_calls[0][2]
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    for index, value in enumerate(outputs):
        if (
            isinstance(value, torch.Tensor)
            and value.numel() == run.logits_TE.numel()
            and relative_error(value.float().reshape(run.logits_TE.shape), run.logits_TE) < 1e-5
        ):
            return index, len(outputs)
    raise UnsupportedBlockError(
        "the router's outputs hold no logits x W^T (+ b): it computes them otherwise"
    )


def answer_of(run: BlockRun, seen: Routed) -> tuple[str, torch.Tensor, bool]:
    """(how the block answers, its hidden-states output [T, H], the shape it answers them in:
    the input's, [T, H] ("tokens") or [T * H] ("flat", with the router logits [T * E]))."""
    output = run.output
    answer = "hidden"
    if isinstance(output, (tuple, list)):
        if len(output) != 2:
            raise UnsupportedBlockError(f"the block answers {len(output)} values")
        output, second = output
        if (
            isinstance(second, torch.Tensor)
            and second.numel() == run.logits_TE.numel()
            and (relative_error(second.float().reshape(run.logits_TE.shape), run.logits_TE) < 1e-5)
        ):
            answer = "hidden_and_router_logits"
        elif (
            isinstance(second, torch.Tensor)
            and second.shape == seen.weights_TK.shape
            and (relative_error(second.float(), seen.weights_TK) < 1e-5)
        ):
            answer = "hidden_and_topk_weights"
        else:
            raise UnsupportedBlockError(
                "the block answers the hidden states and something other than the router logits "
                "or the top-k weights"
            )
    tokens, hidden = run.x_TH.shape
    if not isinstance(output, torch.Tensor) or output.numel() != tokens * hidden:
        raise UnsupportedBlockError("the block does not answer hidden states")
    shapes = {3: "input", 2: "tokens", 1: "flat"}  # the probe's input is [batch, sequence, H]
    if output.dim() not in shapes or (output.dim() > 1 and output.shape[-1] != hidden):
        raise UnsupportedBlockError(
            f"the block answers hidden states of shape {tuple(output.shape)} for an input of "
            f"[2, {tokens // 2}, {hidden}]"
        )
    return answer, output.reshape(tokens, hidden).float(), shapes[output.dim()]


def combination(
    run: BlockRun, seen: Routed, y_TH: torch.Tensor, *, identity_T1: torch.Tensor | None = None
) -> tuple[float, float | None]:
    """(scale, identity scale) in y = scale * routed + identity scale * identity_T1 * x +
    gate * shared, `identity_T1` each token's identity experts' weights (None: the block has
    none, nor an identity scale); raises if y is not that."""
    columns = [seen.routed_TH.reshape(-1)]
    if identity_T1 is not None:
        columns.append((identity_T1 * run.x_TH).reshape(-1))
    shared_column = None
    if run.shared_output_TH is not None:
        shared_TH = run.shared_output_TH
        if run.shared_gate_TH is not None:
            shared_TH = run.shared_gate_TH * shared_TH
        shared_column = len(columns)
        columns.append(shared_TH.reshape(-1))
    if len(run.shared_calls) > 1 or any(
        len(args) + len(kwargs) != 1 for args, kwargs in run.shared_calls
    ):
        raise UnsupportedBlockError(
            "the block calls its shared experts with more than the hidden states"
        )
    basis = torch.stack(columns, dim=1).double()
    solution = torch.linalg.lstsq(basis, y_TH.reshape(-1, 1).double()).solution.reshape(-1)
    fitted = (basis @ solution).float()
    if relative_error(fitted, y_TH.reshape(-1)) > MATCH_TOLERANCE:
        parts = "its routed experts' weighted sum"
        if identity_T1 is not None:
            parts += ", its identity experts' weighted tokens"
        raise UnsupportedBlockError(
            f"the block's output is not {parts} plus its shared experts: it combines them otherwise"
        )
    if shared_column is not None and abs(float(solution[shared_column]) - 1.0) > 1e-4:
        raise UnsupportedBlockError(
            f"the block scales its shared experts' output by {float(solution[shared_column]):.4g}"
        )
    return float(solution[0]), None if identity_T1 is None else float(solution[1])


def worst_token_error(actual_TH: torch.Tensor, expected_TH: torch.Tensor) -> float:
    """The largest relative_error of one token's row: where tokens of several magnitudes are
    probed, the large ones must not hide a difference of the small ones (the erf GELU and the
    tanh one differ by about 1e-4 of a unit-sized value, nothing of a large one)."""
    rows = zip(actual_TH, expected_TH, strict=True)
    return max((relative_error(actual, expected) for actual, expected in rows), default=0.0)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    denominator = float(expected.norm())
    return float((actual - expected).norm()) / (denominator if denominator else 1.0)
