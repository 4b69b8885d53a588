"""megamoe's expert compute as a transformers experts implementation.

transformers >= 5 runs the experts modules of most MoE families through its experts interface:
`experts(hidden_states, top_k_index, top_k_weights)`, computed by the implementation the model's
config names (`experts_implementation="grouped_mm"`, "eager", ...).
`register_experts_implementation()` adds megamoe's under the name "megamoe":

    from megamoe_torch import register_experts_implementation
    register_experts_implementation()
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="megamoe")
    # or, on a loaded model: model.set_experts_implementation("megamoe")

The model keeps its own routers, norms and block code; each experts module computes its
routed experts with megamoe: the dispatch into an expert-major batch, the expert MLP on the
chosen backend (cutedsl on an sm_90 GPU) and the combine, in fixed order. It covers the
families whose blocks swap_moe_blocks cannot replace whole (Gemma 4's experts sit in its decoder
layer, Inkling's shared experts take router gammas, ...), as long as their experts compute what
megamoe computes: what each experts module computes is read once per structure by the same
probes as swap_moe_blocks' (reader.py, on a copy of the module with random weights), and a
module megamoe cannot reproduce (experts gated by the erf GELU, transformers' own expert
parallelism) raises UnsupportedBlockError naming why. A norm of each expert's output
(`post_expert_norm`) is read apart from the projections: with the interface's
has_post_expert_norm (Muse Spark) megamoe applies the module's norm to the expert MLP's output
rows before the combine; without it the module's own code applies it around the interface's
call (Ergo, whose experts compute one route per row).

FP8 checkpoints' experts (transformers' FP8Experts, e4m3 with 128 x 128 block scales) look their
implementation up in an interface of their own: megamoe registers there too, and their layers are
FP8 layers on the module's e4m3 weights and scales (DeepSeek-V4's FP4 experts: e4m3 copies
holding their values, hf/fp4.py).

The layer shares the module's weight tensors (their Parameters, where megamoe's layout is the
module's: `gate_up_proj` [E, 2I, H] of gate rows then up rows, `down_proj` [E, H, I]), so
moving the model or loading weights in place reaches it, and gradients reach the module's
parameters; other layouts (transposed, interleaved) are laid out once per weight version.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from torch import nn

from megamoe_torch.hf.convert import layer_from_hf_tensors
from megamoe_torch.hf.families import UnsupportedBlockError
from megamoe_torch.hf.fp4 import fp8_experts_view, reads_through_fp8_view
from megamoe_torch.hf.fp8 import activation_dtype_of
from megamoe_torch.hf.reader import read_block
from megamoe_torch.layer import MegaMoE

EXPERTS_IMPLEMENTATION = "megamoe"
# the child of an experts module that normalises each expert's output
POST_EXPERT_NORM = "post_expert_norm"
# the options of the layers it builds: how they run (the routing is the model's, on one GPU)
EXPERTS_OPTIONS = ("backend", "capacity", "check_inputs", "tile_pack", "weight_dtype")
# the run options the registered implementation builds its layers with
_OPTIONS: dict[str, Any] = {}
# per experts module: (the tensors it was built from, by id and version, and the layer per top-k)
_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_experts_implementation(**options: Any) -> str:
    """Registers megamoe's expert compute in transformers' experts interface and returns its
    name, "megamoe". `options`: how the layers it builds run, any of EXPERTS_OPTIONS (backend,
    capacity, check_inputs, tile_pack, and weight_dtype: "auto", "fp8" or None, as from_hf
    takes them; `backend="reference"` on a CPU). Registering again replaces the options; the
    layers built so far are built again at their next call."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as error:
        raise ImportError(
            "register_experts_implementation needs transformers >= 5, whose experts interface "
            "(transformers.integrations.moe) it registers in"
        ) from error
    unknown = sorted(set(options) - set(EXPERTS_OPTIONS))
    if unknown:
        raise TypeError(
            f"unexpected options {unknown}: accepted are {list(EXPERTS_OPTIONS)} (the layers "
            "compute what the experts module computes, on one GPU)"
        )
    _OPTIONS.clear()
    _OPTIONS.update(options)
    _LAYERS.clear()
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, megamoe_experts_forward)
    try:  # FP8 checkpoints' experts (FP8Experts) look their implementation up apart
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:
        pass
    else:
        ALL_FP8_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, megamoe_experts_forward)
    return EXPERTS_IMPLEMENTATION


def megamoe_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts module `self`'s output [T, H] for its tokens [T, H] and their top-k experts
    and weights [T, K], computed by megamoe (the module doc), in the tokens' dtype."""
    if getattr(self, "_is_expert_parallel", False):
        raise UnsupportedBlockError(
            f"{type(self).__name__} runs under transformers' expert parallelism, whose "
            "sentinel ids megamoe's implementation does not take: use swap_moe_blocks with a "
            "process_group, or another experts_implementation"
        )
    if top_k_index.dim() != 2:
        raise ValueError(f"top_k_index must be [tokens, top_k], got {tuple(top_k_index.shape)}")
    layer = _layer(self, top_k_index.shape[1], hidden_states.dtype)
    norm = (
        getattr(self, POST_EXPERT_NORM, None)
        if getattr(self, "has_post_expert_norm", False)
        else None
    )
    y_TH = layer.routed_experts(
        hidden_states.to(layer.activation_dtype), top_k_index, top_k_weights, expert_rows_fn=norm
    )
    return y_TH.to(hidden_states.dtype)


class _Passthrough(nn.Module):
    """Stands in for an experts module's post-expert norm while its projections are read: the
    norm is applied apart (megamoe_experts_forward)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


def _projections(experts: nn.Module) -> nn.Module:
    """`experts` without its post-expert norm (a shallow copy), where it has one."""
    if POST_EXPERT_NORM not in experts._modules:
        return experts
    view = copy.copy(experts)
    view._modules = {**experts._modules, POST_EXPERT_NORM: _Passthrough()}
    return view


class _RoutedExperts(nn.Module):
    """A block around an experts module alone, as reader.py reads blocks: a softmax top-k
    router of random weights, then the experts (only what the experts compute is kept)."""

    def __init__(
        self,
        experts: nn.Module,
        num_experts: int,
        hidden_size: int,
        top_k: int,
        dtype: torch.dtype,
    ):
        super().__init__()
        # read for its structure alone: a meta tensor (no memory) in the experts' dtype
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, device="meta", dtype=dtype)
        self.experts = experts
        self.top_k = top_k

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights_TK, ids_TK = torch.softmax(self.gate(x_TH), dim=-1).topk(self.top_k, dim=-1)
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return self.experts(x_TH, ids_TK, weights_TK).reshape(hidden_states.shape)


@torch.compiler.disable  # probes and a cache lookup, never traced: one graph break a call
def _layer(experts: nn.Module, top_k: int, hidden_dtype: torch.dtype) -> MegaMoE:
    """The MegaMoE computing `experts`' MLPs for `top_k` experts per token on hidden states of
    `hidden_dtype`, built at the first call (and again once the module holds other weight
    tensors or the options change)."""
    tensors = tuple(
        (name, id(tensor), tensor._version)
        for name, tensor in experts.state_dict(keep_vars=True).items()
    )
    built = _LAYERS.get(experts)
    if built is None or built[0] != tensors:
        built = (tensors, {})
        _LAYERS[experts] = built
    layers = built[1]
    key = (top_k, hidden_dtype)
    if key not in layers:
        layers[key] = _build_layer(experts, top_k, hidden_dtype)
    return layers[key]


def _build_layer(experts: nn.Module, top_k: int, hidden_dtype: torch.dtype) -> MegaMoE:
    experts = _projections(experts)
    held = experts.state_dict(keep_vars=True)
    # FP4 experts (DeepSeek-V4's) and ue8m0 scales are read as the FP8 experts they convert to
    read = fp8_experts_view(experts) if reads_through_fp8_view(experts) else experts
    read_tensors = read.state_dict(keep_vars=True)
    weight = next(
        (
            read_tensors[name]
            for name in ("gate_up_proj", "up_proj", "mlp.w1")
            if name in read_tensors
        ),
        None,
    )
    num_experts = getattr(experts, "num_experts", None)
    if weight is None or not isinstance(num_experts, int):
        raise UnsupportedBlockError(
            f"{type(experts).__name__} holds no stacked expert weights megamoe reads "
            f"(its tensors: {sorted(held)})"
        )
    hidden = weight.shape[1] if getattr(experts, "is_transposed", False) else weight.shape[-1]
    # e4m3 experts do not show the activations' dtype: the model's config says it, else the
    # hidden states do
    dtype = activation_dtype_of(
        expert_dtype=weight.dtype,
        model_config=getattr(experts, "config", None),
        router_dtype=hidden_dtype,
    )
    block = _RoutedExperts(read, num_experts, hidden, min(top_k, num_experts), dtype)
    reading = read_block(block, structure_only=True)
    fields = dict(reading.config_fields, top_k=top_k)
    # the block's router is a stand-in: its routing fields do not matter, its weight is unused
    hf_tensors = {f"experts.{name}": tensor for name, tensor in held.items()}
    device = held[next(iter(held))].device  # the weights' (the FP4 view's are on meta)
    hf_tensors[reading.naming.router_weight] = torch.zeros(
        num_experts, hidden, device=device, dtype=dtype
    )
    options = dict(_OPTIONS)
    weight_dtype = options.pop("weight_dtype", "auto")
    return layer_from_hf_tensors(
        hf_tensors,
        fields=fields,
        naming=reading.naming,
        options=options,
        weight_dtype=weight_dtype,
        layer_class=MegaMoE,
        device=device,
        activation_dtype=dtype,
    ).train(experts.training)
