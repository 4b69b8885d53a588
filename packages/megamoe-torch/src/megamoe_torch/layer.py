"""MegaMoE: router + routed experts (+ optional shared experts) as one nn.Module.

Shape legend: T tokens, H hidden size, E experts, K experts per token, I intermediate size,
M expert-batch rows.

forward: logits = x W_gate^T -> route (top-k ids, weights) -> dispatch into an expert-major batch
-> expert MLP (the chosen backend) -> combine (weighted top-k sum) [+ shared experts].

On one sm_90 GPU without autograd the routing, the dispatch and the combine run as two device
kernels (DeviceRoutedDispatcher): a forward is the router GEMM (at decode sizes the
router-logits kernel, on every path, which lets the routing kernel start before it ends), one
routing launch, the two expert GEMMs and one combine launch (plus the shared experts'
GEMMs), within an ulp or two of the torch path's routing weights (DeviceRoutedDispatcher says where
they differ), deterministic. `config.layer_path` chooses ("auto", "fused", "torch"). Under
torch.compile such a forward is the router (traced: the GEMM library, or the custom op
megamoe::router_logits where an eager forward takes the kernel) and the custom op
megamoe::fused_moe (ops.py), which runs the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields, replace

import torch
from megamoe_kernels import (
    ROUTER_LOGITS_MAX_TOKENS,
    SwiGLU,
    can_gather_rows,
    gathers_rows_by_default,
    router_logits_faster_tokens,
    shared_experts_in_batch_by_default,
    weight_scales_shape,
)
from megamoe_runtime.dispatch import LocalDispatcher, RowWeightsDispatcher
from megamoe_runtime.dispatch.checks import check_expert_ids
from megamoe_runtime.dispatch.device_routed import (
    DeviceRoutedDispatcher,
    device_routing_status,
    shared_experts_batch_problems,
)
from megamoe_runtime.distributed import (
    injected_dispatcher_group,
    local_expert_range,
    make_expert_parallel_dispatcher,
    select_dispatcher,
)
from megamoe_runtime.experts import backend_status, first_experts, make_backend, select_backend
from megamoe_runtime.routing import check_finite_logits, route, weights_of_chosen
from megamoe_runtime.tuning.online import OnlineAutotuner
from megamoe_runtime.weights import (
    FP8_WEIGHT_DTYPE,
    Prequantized,
    Unquantized,
    WeightPack,
    with_dense_experts,
)
from torch import nn

from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.forward_graphs import ForwardGraphs
from megamoe_torch.fp8_linear import BlockFP8Linear, quantize_loaded_weights
from megamoe_torch.ops import (
    expert_mlp,
    expert_parallel_mlp,
    fused_moe,
    fused_path_runs,
    register_layer,
    router_kernel,
    router_kernel_runs,
)
from megamoe_torch.ops import router_logits as router_logits_op
from megamoe_torch.tensor_cache import DerivedTensorCache

# what a forward that trains a sparsemixer layer says
SPARSEMIXER_IN_TRAINING = (
    "scoring='sparsemixer' (PhiMoE) samples its experts in training, with a gradient estimator "
    "of its own, which MegaMoE does not reproduce: it computes the inference routing, in eval "
    "mode or without gradients (torch.no_grad()); call .eval() on the module (or the model)"
)
# what torch.compile(fullgraph=True) of a layer with check_inputs=True says
CHECK_INPUTS_UNDER_COMPILE = (
    "MegaMoE(check_inputs=True) reads the input and the router logits on the host (a sync "
    "each), which a compiled graph cannot hold: compile with fullgraph=False (the checks then "
    "run between graphs) or build the layer with check_inputs=False"
)
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch.mm(..., out_dtype=), torch >= 2.9
# Up to this many tokens, and as many as the router's size lets the kernel win
# (megamoe_kernels.router_logits_faster_tokens), router_logits computes the logits with the
# router-logits kernel (megamoe_kernels.RouterLogitsLauncher: launched with programmatic
# dependent launch, the routing kernel after it scheduled before it ends at decode) in place of
# the GEMM library; 0 keeps the GEMM library at every size. The kernel's own bound (128 tokens,
# the layer's own graphs'): under the router's size rule no forward measured up to it was
# slower with the kernel past its readings' spread (docs/benchmarks.md, "Router logits at
# decode", scripts/router_ab.py). A module constant so one process can A/B the two. It is read
# by each launched forward and each capture: a graph the layer captured keeps what it recorded
# (layer._forward_graphs.clear()).
ROUTER_KERNEL_MAX_TOKENS = ROUTER_LOGITS_MAX_TOKENS


def _bf16_mm_to_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a @ b in one bf16 GEMM with fp32 accumulation and output, or None where torch lacks it."""
    return torch.mm(a, b, out_dtype=torch.float32) if _MM_OUT_DTYPE else None


def _router_kernel_max_tokens(weight_EH: torch.Tensor) -> int:
    """Up to how many tokens the router-logits kernel computes logits of this weight:
    ROUTER_KERNEL_MAX_TOKENS, and the tokens its size lets the kernel win."""
    return min(ROUTER_KERNEL_MAX_TOKENS, router_logits_faster_tokens(*weight_EH.shape))


def _float32_of(parameter: torch.Tensor, cache: DerivedTensorCache) -> torch.Tensor:
    """A router parameter in fp32. Without autograd the cast is kept in `cache` until the
    parameter changes (in place or replaced), so an inference forward does not cast it again:
    a launch fewer per forward for gpt-oss's router bias (under torch.compile the compiled
    graph holds the cast)."""
    if (
        parameter.dtype == torch.float32
        or (torch.is_grad_enabled() and parameter.requires_grad)
        or torch.compiler.is_compiling()
    ):
        return parameter.float()  # a no-op, or a cast autograd records or the graph holds
    return cache.get((parameter,), lambda: parameter.detach().float(), context=(parameter.device,))


def _int32_or_int64(ids: torch.Tensor) -> torch.Tensor:
    """Integer ids as they are where int32 or int64 (what torch's indexing and the routing
    kernel take), else as int64: uint8 ones would index as a mask."""
    return ids if ids.dtype in (torch.int32, torch.int64) else ids.long()


_SIDE_STREAMS: dict[tuple, torch.cuda.Stream] = {}


def _side_stream(main: torch.cuda.Stream) -> torch.cuda.Stream:
    """The side stream of a caller's stream, shared by every layer forking from it: each use
    starts behind everything issued on `main` and ends joined to it, so what one use frees is
    reused only after `main` has read it. One per caller stream: a side stream two callers'
    streams fork from would reuse memory the other one may still read."""
    key = (main.device, main.cuda_stream)
    side = _SIDE_STREAMS.get(key)
    if side is None:
        side = _SIDE_STREAMS[key] = torch.cuda.Stream(main.device)
    return side


class SharedExperts(nn.Module):
    """A dense SwiGLU MLP every token goes through, optionally scaled by a sigmoid gate.

    `fp8`: the projections hold e4m3 weights with 128 x 128 block scales (BlockFP8Linear:
    `weight` and `weight_scale_inv`, as FP8 checkpoints store them); the gate stays in the
    activations' dtype. `swiglu`: the activation, silu(gate) * up when None; a clamped or
    scaled one is computed in fp32 and rounded once to the activations' dtype.
    `activation="relu2"`: an ungated MLP down(relu(up x)^2) (Nemotron-H), no gate_proj.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        gated: bool,
        fp8: bool = False,
        swiglu: SwiGLU | None = None,
        activation: str = "swiglu",
        **factory,
    ):
        super().__init__()
        self.swiglu = SwiGLU() if swiglu is None else swiglu
        self._plain_swiglu = self.swiglu.is_plain  # decided once, not at every forward

        def projection(in_features: int, out_features: int) -> nn.Module:
            if fp8:
                return BlockFP8Linear(in_features, out_features, device=factory.get("device"))
            return nn.Linear(in_features, out_features, bias=False, **factory)

        ungated = activation == "relu2"
        self.gate_proj = None if ungated else projection(hidden_size, intermediate_size)
        self.up_proj = projection(hidden_size, intermediate_size)
        self.down_proj = projection(intermediate_size, hidden_size)
        self.gate = nn.Linear(hidden_size, 1, bias=False, **factory) if gated else None

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        y_TH = self.down_proj(self._activated(x_TH))
        if self.gate is not None:
            y_TH = torch.sigmoid(self.gate(x_TH)) * y_TH
        return y_TH

    def _activated(self, x_TH: torch.Tensor) -> torch.Tensor:
        """The activation's output [T, I], the down projection's input."""
        up_TI = self.up_proj(x_TH)
        if self.gate_proj is None:
            return torch.relu(up_TI).square()
        gate_TI = self.gate_proj(x_TH)
        if self._plain_swiglu:
            return nn.functional.silu(gate_TI) * up_TI
        return self.swiglu(gate_TI, up_TI).to(gate_TI.dtype)


class OutputNorm(nn.Module):
    """The layer's output normalised as A.X-K1's post-MLP RMSNorm computes it: y * rsqrt(mean(y^2)
    + eps) in fp32, rounded to y's dtype, times `weight` [H]."""

    def __init__(self, hidden_size: int, eps: float, *, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        y_float = y.float()
        normed = y_float * torch.rsqrt(y_float.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(y.dtype)).to(y.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _check_routing_weights_on_input(
    config: MegaMoEConfig, *, process_group: torch.distributed.ProcessGroup | None
) -> None:
    """Refuses expert parallelism for routing_weights_on_input=True (every backend and the
    fused path on one GPU compute it)."""
    if config.routing_weights_on_input and process_group is not None:
        raise ValueError(
            "routing_weights_on_input=True needs each batch row's routing weight where the expert "
            "runs, which the expert-parallel dispatchers do not send: build the layer without "
            "process_group"
        )


def _quantize_loaded_expert_weights(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """load_state_dict pre-hook of an FP8 layer: full-precision `w13`/`w2` without their
    `*_scale_inv` are quantized per 128 x 128 block as they load (a bf16 checkpoint into an
    FP8 layer); e4m3 ones with their scales load as they are."""
    quantize_loaded_weights(state_dict, (prefix + "w13", prefix + "w2"))


def _check_loaded_routing_table(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """load_state_dict pre-hook of a layer that routes by token id: the routing table it loads
    is [V, top_k] integers naming experts in [0, E) (a host sync, at load), so that no id past
    the experts reaches the dispatch."""
    table = state_dict.get(prefix + "routing_table")
    if table is None:
        return
    config = module.config
    shape = (config.routing_table_vocab_size, config.top_k)
    if (
        not isinstance(table, torch.Tensor)
        or table.is_floating_point()
        or table.dtype == torch.bool
    ):
        raise TypeError(f"routing_table must be an integer tensor, got {table!r:.80}")
    if tuple(table.shape) != shape:
        raise ValueError(f"routing_table must have shape {list(shape)}, got {list(table.shape)}")
    if table.numel() and not bool(((table >= 0) & (table < config.num_experts)).all()):
        raise ValueError(f"routing_table names experts outside [0, {config.num_experts})")


class MegaMoE(nn.Module):
    """A Mixture-of-Experts block.

    Parameters: `gate.weight` [E, H] (and `gate.bias` [E] with router_bias; [E + Z, H] and
    [E + Z] with Z num_identity_experts, as the correction bias); `w13` [E, 2I, H]
    (each expert's gate rows, then up rows; activation="relu2": [E, I, H], the up rows alone);
    `w2` [E, H, I]; `w13_bias` [E, 2I] ([E, I]) and `w2_bias` [E, H] with expert_bias;
    `e_score_correction_bias` [E] (fp32 buffer) when the config asks for it; `shared_experts`
    when num_shared_experts > 0; with latent_size L `latent_in.weight` [L, H] and
    `latent_out.weight` [H, L], the routed experts' H then L (`w13` [E, 2I, L], `w2` [E, L, I]);
    with output_norm_eps `output_norm.weight` [H]; with routing_table_vocab_size V the buffer
    `routing_table` [V, top_k] (int64: each token id's experts, in [0, E), checked as it loads).

    weight_dtype="fp8": `w13`/`w2` are e4m3 with float32 block scales `w13_scale_inv`
    [E, ceil(2I/128), ceil(H/128)] and `w2_scale_inv` [E, ceil(H/128), ceil(I/128)] (buffers);
    shared_weight_dtype="fp8": the shared experts' projections likewise (BlockFP8Linear).

    Expert parallel with `process_group` of W ranks: this rank owns the E / W contiguous experts
    `local_experts` and `w13`/`w2` hold only those (router and shared experts are replicated);
    every rank calls forward with its own tokens. `load_full_state_dict` loads the local slice
    from a single-GPU state dict. `config.dispatcher` picks how tokens travel, or `dispatcher`
    brings one the caller built (a `DeepEPDispatcher` over its deep_ep buffer): the layer's
    group is then the dispatcher's (`process_group`, if given, must hold the same ranks), and
    config's capacity, max_tokens_per_rank, combine_order, dispatch_dtype and combine_dtype,
    which configure megamoe's own dispatchers, do not apply to it.

    `device` and `dtype`: where the parameters are made, and their dtype, which is also the
    hidden states' (`activation_dtype`); FP8 experts and an fp32 router weight keep theirs.
    """

    def __init__(
        self,
        config: MegaMoEConfig,
        *,
        process_group: torch.distributed.ProcessGroup | None = None,
        dispatcher=None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if dtype is not None and (not dtype.is_floating_point or dtype.itemsize < 2):
            raise TypeError(
                "dtype (the activations' and the full-precision weights') must be a floating-"
                "point dtype of 16 bits or more, such as bfloat16, float16 or float32 (e4m3 "
                f"experts: config.weight_dtype='fp8'), got {dtype}"
            )
        self.config = config
        factory = {"device": device, "dtype": dtype}
        # the hidden states' dtype, apart from the router's: a router weight kept in fp32 next to
        # bf16 experts (DeepSeek-V3 in transformers) or e4m3 experts do not say what x is
        self._activation_dtype = dtype if dtype is not None else torch.get_default_dtype()
        experts, hidden, intermediate = (
            config.num_experts,
            config.hidden_size,
            config.intermediate_size,
        )
        if dispatcher is not None:
            if config.dispatcher != "auto":
                raise ValueError(
                    f"config.dispatcher={config.dispatcher!r} names a dispatcher megamoe builds, "
                    f"but dispatcher= brings one ({type(dispatcher).__name__}): leave "
                    "config.dispatcher at 'auto' with an injected dispatcher"
                )
            process_group = injected_dispatcher_group(
                dispatcher,
                process_group,
                num_experts=experts,
                top_k=config.top_k,
                hidden_size=config.expert_hidden_size,
            )
        _check_routing_weights_on_input(config, process_group=process_group)
        if config.num_identity_experts and process_group is not None:
            raise ValueError(
                "num_identity_experts: the expert-parallel dispatchers send every pair to an "
                "expert's rank, and identity experts have none; build the layer without "
                "process_group"
            )
        self.process_group = process_group
        self.local_experts = local_expert_range(experts, process_group)
        local = len(self.local_experts)
        # the router scores the identity experts too, after the routed ones
        scored = experts + config.num_identity_experts
        self.gate = nn.Linear(hidden, scored, bias=config.router_bias, **factory)
        # the latent MoE's projections around the routed experts, whose rows are then latent
        self.latent_in = self.latent_out = None
        if config.latent_size is not None:
            self.latent_in = nn.Linear(hidden, config.latent_size, bias=False, **factory)
            self.latent_out = nn.Linear(config.latent_size, hidden, bias=False, **factory)
        self.output_norm = None
        if config.output_norm_eps is not None:
            self.output_norm = OutputNorm(hidden, config.output_norm_eps, **factory)
        hidden = config.expert_hidden_size  # the routed experts' rows from here on
        # gated experts' w13 holds gate and up rows; ungated ones' the up rows alone
        first_rows = 2 * intermediate if config.gated else intermediate
        if config.weight_dtype == "fp8":
            # e4m3 weights are not trained: only the routing and the activations take gradients
            fp8 = {"device": device, "dtype": FP8_WEIGHT_DTYPE}
            self.w13 = nn.Parameter(
                torch.empty(local, first_rows, hidden, **fp8), requires_grad=False
            )
            self.w2 = nn.Parameter(
                torch.empty(local, hidden, intermediate, **fp8), requires_grad=False
            )
            scales = {"device": device, "dtype": torch.float32}
            for name, weight in (("w13", self.w13), ("w2", self.w2)):
                shape = weight_scales_shape(weight.shape)
                self.register_buffer(f"{name}_scale_inv", torch.empty(shape, **scales))
            self.register_load_state_dict_pre_hook(_quantize_loaded_expert_weights)
        else:
            self.w13 = nn.Parameter(torch.empty(local, first_rows, hidden, **factory))
            self.w2 = nn.Parameter(torch.empty(local, hidden, intermediate, **factory))
            self.register_buffer("w13_scale_inv", None)
            self.register_buffer("w2_scale_inv", None)
        if config.expert_bias:
            self.w13_bias = nn.Parameter(torch.empty(local, first_rows, **factory))
            self.w2_bias = nn.Parameter(torch.empty(local, hidden, **factory))
        else:
            self.register_parameter("w13_bias", None)
            self.register_parameter("w2_bias", None)
        if config.use_correction_bias:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(scored, device=device, dtype=torch.float32)
            )
        else:
            self.e_score_correction_bias = None
        table = None
        if config.routing_table_vocab_size:
            # token id v's experts: v, v + 1, ... (mod E) until loaded
            table = torch.arange(config.routing_table_vocab_size, device=device).unsqueeze(1)
            table = (table + torch.arange(config.top_k, device=device)) % experts
            self.register_load_state_dict_pre_hook(_check_loaded_routing_table)
        self.register_buffer("routing_table", table)
        self.shared_experts = (
            SharedExperts(
                config.hidden_size,
                config.shared_size,
                gated=config.shared_expert_gate,
                fp8=config.shared_weight_dtype == "fp8",
                swiglu=config.shared_experts_swiglu,
                activation=config.activation,
                **factory,
            )
            if config.num_shared_experts
            else None
        )
        self.expert_parallel = local < experts
        self._injected_dispatcher = None
        # expert parallel: built on first forward, once the device and dtype are known
        if dispatcher is not None:
            self._inject(dispatcher)
        elif self.expert_parallel:
            self.dispatcher, self.dispatcher_reason = None, ""
        else:
            # identity experts' pairs: one bucket after the routed experts (_identity_combine)
            buckets = experts + (1 if config.num_identity_experts else 0)
            self.dispatcher = LocalDispatcher(buckets, capacity=config.capacity, check_ids=False)
            self.dispatcher_reason = "single GPU: local"
        self._dispatcher_key: tuple | None = None
        self._backend_name: str | None = None
        self._backend_reason = ""
        self._prepared = DerivedTensorCache()
        self._gate_float32 = DerivedTensorCache()
        self._gate_bias_float32 = DerivedTensorCache()
        # the fused path's dispatcher and, per (device, dtype), whether it can serve the layer
        # (a forward is done with its batch once its own launches have read it)
        self._device_routed = DeviceRoutedDispatcher(
            config.router, hidden_size=hidden, capacity=config.capacity, reuse_outputs=True
        )
        self._fused_status: dict[tuple, tuple[bool, str]] = {}
        # per backend: how many experts the shared experts make in the fused path's batch (0:
        # they run as their own MLP)
        self._shared_in_batch: dict[tuple, int] = {}
        # small eager forwards on the fused path replay CUDA graphs of themselves
        self._forward_graphs = ForwardGraphs(
            max_tokens=config.eager_graph_tokens, max_bucket_tokens=config.bucket_graph_tokens
        )
        # knobs="auto": times the GEMM knobs of each new batch class once (collectively under
        # expert parallelism) and keeps the winner in the knob cache
        self._autotuner = OnlineAutotuner(process_group=process_group)
        # under torch.compile the custom ops (ops.py) find this layer by its id
        self._layer_id = register_layer(self)
        # PhiMoE's sparsemixer samples its experts in training: such a layer refuses to train
        self._refuses_training = config.scoring == "sparsemixer"
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's default initialisation, per expert."""
        hidden, intermediate = self.config.expert_hidden_size, self.config.intermediate_size
        for name, fan_in in (("w13", hidden), ("w2", intermediate)):
            weight = getattr(self, name)
            if weight.dtype == FP8_WEIGHT_DTYPE:
                values = torch.empty(weight.shape, device=weight.device, dtype=torch.float32)
                values.uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
                self.load_expert_weights(**{name: values})
            else:
                weight.uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        if self.w13_bias is not None:
            self.w13_bias.uniform_(-1 / math.sqrt(hidden), 1 / math.sqrt(hidden))
            self.w2_bias.uniform_(-1 / math.sqrt(intermediate), 1 / math.sqrt(intermediate))
        self.gate.reset_parameters()
        for projection in (self.latent_in, self.latent_out):
            if projection is not None:
                projection.reset_parameters()
        if self.output_norm is not None:
            nn.init.ones_(self.output_norm.weight)

    def use_backend(self, backend: str) -> None:
        """Sets the expert-compute backend ('auto' or a name); weights are prepared at next use."""
        self.config = replace(self.config, backend=backend)
        self._backend_name = None

    def use_dispatcher(self, dispatcher) -> None:
        """Hands the layer another dispatcher the caller built over the same group (prefill and
        decode over one DeepEP buffer: a normal-mode and a low-latency DeepEPDispatcher); the
        backend is chosen again for the batches it hands out."""
        if self._injected_dispatcher is None:
            raise ValueError(
                "use_dispatcher switches between dispatchers the caller built; this layer runs "
                f"megamoe's own ({self.dispatcher_reason or 'chosen on first forward'}): build it "
                "with MegaMoE(config, dispatcher=...)"
            )
        injected_dispatcher_group(
            dispatcher,
            self.process_group,
            num_experts=self.config.num_experts,
            top_k=self.config.top_k,
            hidden_size=self.config.expert_hidden_size,
        )
        self._inject(dispatcher)
        self._backend_name = None

    def _inject(self, dispatcher) -> None:
        if self.config.routing_weights_on_input and not isinstance(
            dispatcher, RowWeightsDispatcher
        ):
            raise ValueError(
                f"routing_weights_on_input=True needs a dispatcher that hands out each batch "
                f"row's routing weight (RowWeightsDispatcher: row_weights, combine(weights_applied"
                f"=True)); {type(dispatcher).__name__} does not"
            )
        self._injected_dispatcher = self.dispatcher = dispatcher
        describe = getattr(dispatcher, "describe", None)
        self.dispatcher_reason = "injected: " + (
            describe() if describe is not None else type(dispatcher).__name__
        )

    @torch.no_grad()
    def load_full_state_dict(self, full_state_dict: dict[str, torch.Tensor]) -> None:
        """Loads a single-GPU layer's state dict, keeping only this rank's experts of w13/w2."""
        local_state = dict(full_state_dict)
        expert_tensors = ("w13", "w2", "w13_bias", "w2_bias") if self.config.expert_bias else ()
        for name in expert_tensors or ("w13", "w2"):
            # an FP8 layer's scales travel with their weights (a bf16 state dict has none: its
            # weights are quantized as they load)
            scale_name = f"{name}_scale_inv"
            if self.config.weight_dtype == "fp8" and scale_name in full_state_dict:
                scales = full_state_dict[scale_name]
                local_state[scale_name] = scales[self.local_experts.start : self.local_experts.stop]
            if name not in full_state_dict:
                raise KeyError(
                    f"the full state dict lacks {name!r} (a single-GPU MegaMoE's state dict holds "
                    f"'gate.weight', 'w13', 'w2', ...); its keys: {sorted(full_state_dict)}"
                )
            full = full_state_dict[name]
            if full.shape[0] != self.config.num_experts:
                raise ValueError(
                    f"{name} of the full state dict must hold all {self.config.num_experts} "
                    f"experts, got shape {tuple(full.shape)}"
                )
            local_state[name] = full[self.local_experts.start : self.local_experts.stop]
        self.load_state_dict(local_state)

    def _resolve_dispatcher(self, x_TH: torch.Tensor) -> None:
        if not self.expert_parallel or self._injected_dispatcher is not None:
            return
        key = (x_TH.device, x_TH.dtype)
        if key == self._dispatcher_key:
            return
        name, self.dispatcher_reason = select_dispatcher(self.config.dispatcher, x_TH.device)
        self.dispatcher = make_expert_parallel_dispatcher(
            name,
            num_experts=self.config.num_experts,
            top_k=self.config.top_k,
            hidden_size=self.config.expert_hidden_size,
            dtype=x_TH.dtype,
            device=x_TH.device,
            process_group=self.process_group,
            capacity=self.config.capacity,
            max_tokens_per_rank=self.config.max_tokens_per_rank,
            combine_order=self.config.combine_order,
            dispatch_dtype=self.config.dispatch_dtype,
            combine_dtype=self.config.combine_dtype,
        )
        self._dispatcher_key = key

    @property
    def backend(self) -> str:
        """The expert-compute backend this layer runs on its current device."""
        self._resolve_backend()
        return self._backend_name

    @property
    def backend_reason(self) -> str:
        """Why `backend` was chosen ("auto": which backends were skipped, and why)."""
        self._resolve_backend()
        return self._backend_reason

    def _resolve_backend(self) -> None:
        device = self.w13.device
        if self._backend_name is None or self._backend_device != device:
            self._backend_name, self._backend_reason = select_backend(
                self.config.backend,
                device,
                masked_batches=bool(getattr(self.dispatcher, "masked_batches", False)),
                fp8_rows=bool(getattr(self.dispatcher, "fp8_batches", False)),
                fp8_weights=self.config.weight_dtype == "fp8",
                expert_math=self.config.expert_math_features,
            )
            self._backend_device = device
            self._expert_backend = make_backend(self._backend_name, tile_pack=self.config.tile_pack)
            self._prepared.clear()

    def _prepared_weights(self, *, shared_in_batch: bool = False):
        """The backend's layout of the routed experts, or with `shared_in_batch` of the routed
        then the shared experts (_shared_experts_in_batch). A layer whose shared experts may
        join the batch prepares them once, with the shared ones: a batch of the routed experts
        alone takes a view of its first experts."""
        shared = self._shared_batch_experts()

        def prepare():
            with torch.no_grad():
                pack = self.shared_in_batch_weight_pack() if shared else self.expert_weight_pack()
                prepared = self._expert_backend.prepare(pack)
                if shared:
                    self._point_routed_weights_into(prepared)
            # and the routed experts' views of them (a batch without the shared experts)
            return prepared, first_experts(prepared, len(self.local_experts)) if shared else None

        weights = [
            self.w13,
            self.w2,
            self.w13_scale_inv,
            self.w2_scale_inv,
            self.w13_bias,
            self.w2_bias,
        ]
        if shared:
            for projection in self._shared_projections():
                weights += [projection.weight, getattr(projection, "weight_scale_inv", None)]
        # the backend's layout is rebuilt only when the weights change (in place or replaced);
        # the cache alone holds it, so a backend switch or a rebuild frees it first
        prepared, routed = self._prepared.get(
            weights, prepare, context=(self._backend_name, shared)
        )
        return prepared if not shared or shared_in_batch else routed

    def _point_routed_weights_into(self, prepared) -> None:
        """Weights prepared with the shared experts copy the routed experts' (with_dense_experts
        concatenates them): where a prepared tensor holds w13 or w2 as it is (dtype, layout and
        values) as its first experts, the parameter becomes a view of it, so that the routed
        weights are held once (the parameter's own storage is freed where nothing else holds
        it). An interleaved or packed copy differs in layout and is left alone, as is every
        tensor while the stream captures a graph (the value check reads them on the host)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        experts = len(self.local_experts)
        candidates = [
            value
            for field in fields(prepared)
            if isinstance(value := getattr(prepared, field.name), torch.Tensor)
        ]

        def bits(t: torch.Tensor) -> torch.Tensor:  # e4m3 compares as its bytes
            return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

        def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
            # an expert at a time: torch.equal's elementwise result takes a byte per element,
            # 7 GiB beside DeepSeek-V3's w13 (256 x 4096 x 7168) at the memory's peak
            return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))

        for parameter in (self.w13, self.w2):
            for tensor in candidates:
                if (
                    tensor.dtype == parameter.dtype
                    and tensor.device == parameter.device
                    and tensor.shape[1:] == parameter.shape[1:]
                    and tensor.shape[0] > experts
                    and tensor.is_contiguous()
                    and same_values(tensor[:experts], parameter)
                ):
                    parameter.data = tensor[:experts]
                    break

    def _shared_batch_experts(self) -> int:
        """How many experts the shared experts make when they join the fused path's batch, S =
        shared_size / intermediate_size, or 0 where they never do: where no forward takes the
        fused path on one GPU (expert parallelism, layer_path="torch", no sm_90 GPU), and by
        config.shared_experts_path ("batch": on any backend, an error where the routing
        kernels cannot hold S more experts; "auto": on the cutedsl backend where they can; the
        others: never; the config refuses "batch" for shared experts the batch cannot compute).
        Fixed per backend and device; _shared_experts_in_batch decides per forward."""
        config = self.config
        if self.shared_experts is None or config.shared_experts_path not in ("auto", "batch"):
            return 0
        key = (self._backend_name, self.w13.device)
        shared = self._shared_in_batch.get(key)
        if shared is None:
            shared = config.shared_size // config.intermediate_size
            if (
                config.shared_experts_in_batch_problems
                or not self._routes_on_this_gpu
                or not self.fused_path_status()[0]
                or (config.shared_experts_path == "auto" and self._backend_name != "cutedsl")
            ):
                shared = 0
            else:
                problems = shared_experts_batch_problems(
                    config.router, hidden_size=config.hidden_size, shared_experts=shared
                )
                if problems and config.shared_experts_path == "batch":
                    raise ValueError(
                        "shared_experts_path='batch' cannot put the shared experts into the "
                        f"routed batch: {'; '.join(problems)}"
                    )
                shared = 0 if problems else shared
            self._shared_in_batch[key] = shared
        return shared

    def _shared_experts_in_batch(self, tokens: int) -> int:
        """How many experts the shared experts make in the batch of a fused forward of
        `tokens` tokens (0: they run as their own MLP): _shared_batch_experts() always with
        shared_experts_path="batch", and with "auto" where the measured rule says so
        (megamoe_kernels.shared_experts_in_batch_by_default)."""
        shared = self._shared_batch_experts()
        if not shared or self.config.shared_experts_path == "batch":
            return shared
        joins = shared_experts_in_batch_by_default(
            tokens=tokens,
            valid_rows=tokens * (self.config.top_k + shared),
            capacity=self._device_routed.batch_capacity(tokens, shared_experts=shared),
            num_experts=self.config.num_experts + shared,
            fp8=self.config.weight_dtype == "fp8",
        )
        return shared if joins else 0

    def expert_weight_pack(self, *, detach: bool = True) -> WeightPack:
        """The routed experts' weights as a runtime pack: Unquantized (with the expert biases and
        the SwiGLU the config asks for), or with weight_dtype='fp8' Prequantized (e4m3, their
        block scales and the SwiGLU)."""

        def tensor(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.detach() if detach and t is not None else t

        if self.w13_scale_inv is None:
            return Unquantized(
                w13_E2IH=tensor(self.w13),
                w2_EHI=tensor(self.w2),
                w13_bias_E2I=tensor(self.w13_bias),
                w2_bias_EH=tensor(self.w2_bias),
                swiglu=self.config.swiglu,
                activation=self.config.activation,
            )
        return Prequantized(
            w13_E2IH=self.w13.detach(),
            w13_scales=self.w13_scale_inv,
            w2_EHI=self.w2.detach(),
            w2_scales=self.w2_scale_inv,
            swiglu=self.config.swiglu,
        )

    def shared_in_batch_weight_pack(self) -> WeightPack:
        """The weights of a batch the shared experts join: expert_weight_pack with the shared
        MLP appended as shared_size / intermediate_size dense experts after the routed ones
        (with_dense_experts; FP8 shared experts as their e4m3 weights and block scales),
        detached."""
        gate, up, down = self._shared_projections()
        scales = None
        if self.config.shared_weight_dtype == "fp8":
            scales = (gate.weight_scale_inv, up.weight_scale_inv, down.weight_scale_inv)
        return with_dense_experts(
            self.expert_weight_pack(),
            gate_FH=gate.weight.detach(),
            up_FH=up.weight.detach(),
            down_HF=down.weight.detach(),
            scales=scales,
        )

    def _shared_projections(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        """The shared MLP's gate, up and down projections (nn.Linear or BlockFP8Linear)."""
        mlp = self.shared_experts
        return mlp.gate_proj, mlp.up_proj, mlp.down_proj

    @torch.no_grad()
    def load_expert_weights(
        self, *, w13: torch.Tensor | None = None, w2: torch.Tensor | None = None
    ) -> None:
        """Copies full-precision expert weights ([local experts, 2I, H] (ungated: [.., I, H])
        and [local experts, H, I], any float dtype) into the layer: as they are, or with
        weight_dtype='fp8' quantized per 128 x 128 block (each block's amax / 448:
        deterministic)."""
        from megamoe_kernels import quantize_weight_blocks

        given = [
            (name, values) for name, values in (("w13", w13), ("w2", w2)) if values is not None
        ]
        for name, values in given:  # all checked before any is written
            if not isinstance(values, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
            if not values.is_floating_point():
                raise TypeError(f"{name} must hold floating-point values, got {values.dtype}")
            shape = getattr(self, name).shape
            if tuple(values.shape) != tuple(shape):
                raise ValueError(f"{name} must have shape {list(shape)}, got {list(values.shape)}")
        for name, values in given:
            weight = getattr(self, name)
            if weight.dtype != FP8_WEIGHT_DTYPE:
                weight.copy_(values)
                continue
            quantized, scales = quantize_weight_blocks(values.to(weight.device))
            weight.copy_(quantized)
            getattr(self, f"{name}_scale_inv").copy_(scales)

    def _records_autograd(self, *tensors: torch.Tensor) -> bool:
        """Whether autograd records a computation on `tensors` and the routed experts' weights
        (then a forward takes the torch path and backends with a backward)."""
        experts = (self.w13, self.w2, self.w13_bias, self.w2_bias)
        return torch.is_grad_enabled() and any(
            tensor is not None and tensor.requires_grad for tensor in (*tensors, *experts)
        )

    def _expert_compute(self, batch):
        if not self._records_autograd(batch.rows_MH):
            if torch.compiler.is_compiling():
                batch = batch.dequantized()  # the op takes full-precision rows
                valid_rows = -1 if batch.valid_rows is None else batch.valid_rows
                return expert_mlp(
                    batch.rows_MH,
                    batch.expert_offsets,
                    self.w13,
                    self.w2,
                    self._layer_id,
                    valid_rows,
                    batch.expert_counts,
                )
            return self._run_expert_backend(batch)
        backend = self._autograd_backend()
        # autograd backends take the live parameters as they are (their prepare is the identity)
        return backend(batch, backend.prepare(self.expert_weight_pack(detach=False)))

    def _run_expert_backend(self, batch, *, shared_in_batch: bool = False, **combine):
        """The chosen backend on its prepared weights (tuned first when knobs='auto'); with
        `shared_in_batch` the batch holds the shared experts after the routed ones; `combine`:
        the cutedsl backend's row_scale_M, row_tokens_M and out_TH (the atomic combine)."""
        prepared = self._prepared_weights(shared_in_batch=shared_in_batch)
        if self.config.knobs == "auto":  # FP8 experts too: their GEMMs have knobs of their own
            self._autotuner.ensure_tuned(self._expert_backend, batch, prepared)
        return self._expert_backend(batch, prepared, **combine)

    def _autograd_backend(self):
        """The backend for a forward that autograd records: the chosen one if it has a backward;
        under 'auto', the best backend that has one; an explicit choice without one raises."""
        self._resolve_backend()  # after use_backend, the new choice's
        if getattr(self._expert_backend, "supports_autograd", False):
            return self._expert_backend
        if self.config.backend != "auto":
            raise RuntimeError(
                f"backend {self._backend_name!r} has no backward: run the layer under "
                "torch.no_grad()/torch.inference_mode() for inference, or pick backend='auto' "
                "(or 'grouped_mm'/'reference') to train"
            )
        device = self.w13.device
        expert_math = self.config.expert_math_features
        grouped_mm = backend_status("grouped_mm", device, expert_math=expert_math)[0]
        return make_backend("grouped_mm" if grouped_mm else "reference")

    def router_logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        """logits_TE of the router: fp32 for router_dtype='float32' (the bias added in fp32),
        x's dtype for 'input'. 1 to ROUTER_KERNEL_MAX_TOKENS bf16 tokens, and no more than the
        router's size lets the kernel win (megamoe_kernels.router_logits_faster_tokens), on an
        sm_90 GPU, not recorded by autograd, take the router-logits kernel (eager and compiled
        forwards, every layer path: the same bits on each); others the GEMM library."""
        gate = self.gate
        weight, bias = gate.weight, gate.bias  # looked up once: nn.Module attribute lookups cost
        if self._router_kernel_takes(x_TH, weight, bias):
            logits_dtype = torch.float32 if self.config.router_dtype == "float32" else x_TH.dtype
            kernel_key = (
                *weight.shape,
                logits_dtype,
                None if bias is None else bias.dtype,
                x_TH.device,
            )
            if torch.compiler.is_compiling():
                if router_kernel_runs(*kernel_key):
                    return router_logits_op(x_TH, weight, bias, logits_dtype)
            else:
                launcher = router_kernel(*kernel_key)
                if launcher is not None:
                    return launcher(x_TH.contiguous(), weight, bias_E=bias)
        if self.config.router_dtype == "float32":
            if (
                x_TH.is_cuda
                and x_TH.dtype == weight.dtype == torch.bfloat16
                and not (torch.is_grad_enabled() and (x_TH.requires_grad or weight.requires_grad))
            ):
                # the same products (bf16 x bf16 is exact in fp32) accumulated in fp32 by one
                # bf16 GEMM: no fp32 copy of x, and a tensor-core GEMM in place of an fp32 one
                # (at qwen3-30b-a3b 8192 tokens 180 us of cast + fp32 GEMM)
                logits_TE = _bf16_mm_to_float32(x_TH, weight.t())
                if logits_TE is not None:
                    return self._add_router_bias(logits_TE, bias)
            return self._add_router_bias(
                nn.functional.linear(x_TH.float(), self._gate_weight_float32()), bias
            )
        return gate(x_TH)

    @staticmethod
    def _router_kernel_takes(
        x_TH: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> bool:
        """Whether these tokens and the router's weight and bias are of the kind the
        router-logits kernel takes (router_kernel says whether it runs on their device)."""
        return (
            x_TH.is_cuda
            and 0 < x_TH.shape[0] <= _router_kernel_max_tokens(weight)
            and x_TH.dtype == weight.dtype == torch.bfloat16
            and weight.is_contiguous()
            and (bias is None or bias.is_contiguous())
            # the kernel has no backward
            and not (
                torch.is_grad_enabled()
                and (
                    x_TH.requires_grad
                    or weight.requires_grad
                    or (bias is not None and bias.requires_grad)
                )
            )
        )

    def _add_router_bias(self, logits_TE: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """fp32 logits plus the router's bias (router_bias=True), added in fp32."""
        if bias is None:
            return logits_TE
        return logits_TE + _float32_of(bias, self._gate_bias_float32)

    def _gate_weight_float32(self) -> torch.Tensor:
        """The router weight in fp32 (kept until it changes: _float32_of)."""
        return _float32_of(self.gate.weight, self._gate_float32)

    def fused_path_status(self, device: torch.device | str | None = None) -> tuple[bool, str]:
        """(whether a forward on `device` runs the device routing kernels, why): on one GPU the
        fused path (routing, dispatch and combine); under expert parallelism the routing alone,
        whose ids and weights the dispatcher takes. Autograd aside: a forward that records
        gradients always takes the torch path."""
        device = self.w13.device if device is None else torch.device(device)
        key = (device, self.activation_dtype)
        status = self._fused_status.get(key)
        if status is None:
            if self.config.layer_path == "torch":
                status = (False, "layer_path='torch'")
            elif self.config.latent_size is not None:
                status = (False, "latent_size: the fused path is not built for latent projections")
            elif self.config.num_identity_experts:
                status = (False, "num_identity_experts: the fused path is not built for them")
            else:
                status = device_routing_status(
                    self.config.router,
                    hidden_size=self.config.hidden_size,
                    dtype=self.activation_dtype,
                    device=device,
                )
            if self.config.layer_path == "fused" and not status[0]:
                raise ValueError(f"layer_path='fused' cannot run on {device}: {status[1]}")
            self._fused_status[key] = status
        return status

    def _runs_fused(self, x_TH: torch.Tensor) -> bool:
        compiling = torch.compiler.is_compiling()
        if compiling and (
            not self._routes_on_this_gpu
            or self.config.check_inputs
            or self.routing_table is not None
        ):
            # the torch steps are traced (inductor fuses them) around the expert-compute
            # custom ops: the routing kernel alone (expert parallelism) has no fake
            # implementation, check_inputs reads the logits on the host, and the custom op
            # megamoe::fused_moe takes no token ids
            return False
        if torch.is_grad_enabled():
            # the shared experts too: the fused path may compute them from detached weights in
            # the routed batch
            shared = () if self.shared_experts is None else self.shared_experts.parameters()
            if self._records_autograd(x_TH, self.gate.weight, *shared):
                return False
        if compiling:  # on one GPU the custom op megamoe::fused_moe
            return fused_path_runs(self._layer_id, x_TH.device)
        return self.fused_path_status(x_TH.device)[0]

    def _fused_forward(
        self,
        x_TH: torch.Tensor,
        router_logits_TE: torch.Tensor,
        *,
        table_ids_TK: torch.Tensor | None = None,
        out_TH: torch.Tensor | None = None,
        token_count: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Routing + dispatch (one launch), expert compute, combine (one launch, or the down
        GEMM's atomic adds: config.atomic_combine); the shared experts as experts of the batch,
        or their own MLP's output added in the combine. The combine writes into `out_TH` where
        given (a captured forward's static output).
        `table_ids_TK`: the experts the routing table gives the tokens, placed in place of the
        logits' choice and weighted by their scores. `token_count` (int32 [1] on the device, a
        graph of a bucket of token counts): only the first that many of the T tokens are routed
        and combined, and the shared experts join the batch wherever they can (as their own MLP
        they would compute all T rows)."""
        if self.config.check_inputs:
            check_finite_logits(router_logits_TE)
        x_TH = x_TH.contiguous()  # the kernels take row-major rows (a no-op for most inputs)
        if token_count is None:
            shared_in_batch = self._shared_experts_in_batch(x_TH.shape[0])
        else:
            shared_in_batch = self._shared_batch_experts()
        shared_TH = side = None
        if (
            self.shared_experts is not None
            and not shared_in_batch
            and self.config.shared_experts_path != "caller_stream"
        ):
            # forked here, joined before the combine: the side stream starts each forward
            # behind everything issued on the caller's stream, so memory it frees is reused
            # only after the caller's stream has read it, and the reverse
            main = torch.cuda.current_stream(x_TH.device)
            side = _side_stream(main)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared_TH = self.shared_experts(x_TH)
        # FP8 experts: the dispatch quantizes each token as it copies it into its top-k rows;
        # routing_weights_on_input: it scales each row by its pair's weight (the shared
        # experts' weight is 1), and the combine sums the rows unweighted
        weights_on_input = self.config.routing_weights_on_input
        shared_gate_logits_T = None
        if shared_in_batch and self.shared_experts.gate is not None:
            # Qwen2-MoE: the shared pairs weigh sigmoid(x . w_gate) in the combine
            shared_gate_logits_T = self._shared_gate_logits(x_TH)
        # the atomic combine: the routing launch zeroes the output's rows, the down GEMM adds
        # the rows into them
        reduced_TH = None
        if self._combines_atomically():
            reduced_TH = x_TH.new_empty(x_TH.shape) if out_TH is None else out_TH
        batch, handle, _ = self._device_routed.route_and_dispatch(
            x_TH,
            router_logits_TE,
            topk_ids_TK=table_ids_TK,
            correction_bias_E=self.e_score_correction_bias,
            rows_dtype=torch.float8_e4m3fn if self._dispatches_fp8_rows() else None,
            gather_rows=self._gathers_rows(x_TH, shared_in_batch=shared_in_batch),
            shared_experts=shared_in_batch,
            shared_gate_logits_T=shared_gate_logits_T,
            weights_on_input=weights_on_input,
            token_count=token_count,
            reduce_into_TH=reduced_TH,
        )
        combine = {}
        if reduced_TH is not None:
            combine = dict(
                # rows the dispatch scaled by their weights are added as they are
                row_scale_M=None if weights_on_input else handle.row_weights_M,
                row_tokens_M=handle.row_tokens_M,
                out_TH=reduced_TH,
            )
        expert_out_MH = self._run_expert_backend(
            batch, shared_in_batch=bool(shared_in_batch), **combine
        )
        if side is not None:
            main.wait_stream(side)
        elif self.shared_experts is not None and not shared_in_batch:
            shared_TH = self.shared_experts(x_TH)
        if reduced_TH is not None:
            return reduced_TH if shared_TH is None else reduced_TH.add_(shared_TH)
        return self._device_routed.combine(
            expert_out_MH,
            handle,
            addend_TH=shared_TH,
            weights_applied=weights_on_input,
            out_TH=out_TH,
        )

    def _shared_gate_logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        """float32 [T]: x . w_gate of the shared experts' sigmoid gate, for the batch's shared
        pairs (fused path, no autograd): the router-logits kernel for 1 to
        _router_kernel_max_tokens(w_gate) bf16 tokens where it runs, else one bf16 GEMM with
        fp32 output (the products of the router's logits, accumulated in fp32)."""
        weight = self.shared_experts.gate.weight  # [1, H]
        tokens = x_TH.shape[0]
        bf16 = x_TH.dtype == weight.dtype == torch.bfloat16
        if bf16 and 0 < tokens <= _router_kernel_max_tokens(weight):
            launcher = router_kernel(*weight.shape, torch.float32, None, x_TH.device)
            if launcher is not None:
                return launcher(x_TH, weight.detach()).view(tokens)
        logits_T1 = _bf16_mm_to_float32(x_TH, weight.detach().t()) if bf16 else None
        if logits_T1 is None:
            logits_T1 = nn.functional.linear(x_TH.float(), weight.detach().float())
        return logits_T1.view(tokens)

    def _fused_moe_weights(self) -> list[torch.Tensor]:
        """Every tensor _fused_forward reads besides the tokens, the logits and w13/w2: the
        block scales, the expert biases, the correction bias and the shared experts' parameters
        and buffers (the custom op megamoe::fused_moe takes them, ops.py says why)."""
        tensors = [
            self.w13_scale_inv,
            self.w2_scale_inv,
            self.w13_bias,
            self.w2_bias,
            self.e_score_correction_bias,
        ]
        if self.shared_experts is not None:
            tensors += [*self.shared_experts.parameters(), *self.shared_experts.buffers()]
        return [tensor for tensor in tensors if tensor is not None]

    def _fused_forward_from_tokens(
        self,
        x_TH: torch.Tensor,
        *,
        input_ids: torch.Tensor | None = None,
        out_TH: torch.Tensor | None = None,
        token_count: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(y_TH, router_logits_TE) of the fused path, the output norm applied, y written into
        `out_TH` where given: what a captured forward records. `input_ids`: the checked token
        ids of a layer routing by token id. `token_count`: _fused_forward's (a bucket's graph;
        y's rows past the count are then unspecified)."""
        router_logits_TE = self.router_logits(x_TH)
        table_ids_TK = None if self.routing_table is None else self._table_ids(input_ids)
        y_TH = self._fused_forward(
            x_TH,
            router_logits_TE,
            table_ids_TK=table_ids_TK,
            out_TH=out_TH if self.output_norm is None else None,
            token_count=token_count,
        )
        if self.output_norm is None:
            return y_TH, router_logits_TE
        y_TH = self.output_norm(y_TH)
        if out_TH is not None:
            y_TH = out_TH.copy_(y_TH)
        return y_TH, router_logits_TE

    @property
    def _routes_on_this_gpu(self) -> bool:
        """Whether the fused path routes, dispatches and combines on this GPU alone (no expert
        parallelism, no dispatcher the caller brought)."""
        return not self.expert_parallel and self._injected_dispatcher is None

    def _replays_graphs(self, x_TH: torch.Tensor) -> bool:
        """Whether this forward may replay (or capture) a graph of itself: the fused path on
        one GPU with a backend that captures, no host-synchronising checks, not inside another
        capture. The graphs take forwards of 1 to eager_graph_tokens tokens, or to
        bucket_graph_tokens (asked first: ForwardGraphs.takes); a bucket's graph routes its
        bucket's rows, so with a capacity only where the bucket's pairs fit it."""
        return (
            self._forward_graphs.takes(x_TH.shape[0])
            and self._bucket_fits_capacity(x_TH.shape[0])
            # a compiled forward's fused path is the op megamoe::fused_moe, which launches
            # (inductor's CUDA graphs, mode="reduce-overhead", capture it)
            and not torch.compiler.is_compiling()
            and self._routes_on_this_gpu
            and not self.config.check_inputs
            and x_TH.is_cuda
            and self._runs_fused(x_TH)
            and self._expert_backend.captures_in_graphs
            and not torch.cuda.is_current_stream_capturing()
        )

    def _bucket_fits_capacity(self, tokens: int) -> bool:
        """Whether the graph a forward of `tokens` would replay routes no more pairs than the
        layer's capacity holds: a graph of its own shape, or of a bucket of T rows with T x
        top_k <= capacity (None: any)."""
        bucket = self._forward_graphs.bucket_of(tokens)
        capacity = self.config.capacity
        return bucket is None or capacity is None or bucket * self.config.top_k <= capacity

    def _gathers_rows(self, x_TH: torch.Tensor, *, shared_in_batch: int = 0) -> bool:
        """Whether the fused path's gate-up GEMM reads the batch rows from the tokens (the
        dispatch copying none): bf16 experts and tokens on the cutedsl backend, a hidden size of
        whole K tiles, rows that are the tokens as they are (not routing_weights_on_input: the
        dispatch writes each row scaled by its weight), and `gather_rows` asking for it (None:
        the measured choice, gathers_rows_by_default, on the batch's rows: `shared_in_batch`
        more per token)."""
        config = self.config
        if not (
            self._backend_name == "cutedsl"
            and config.weight_dtype is None
            and not config.routing_weights_on_input
            and can_gather_rows(config.hidden_size, x_TH.dtype)
        ):
            return False
        if config.gather_rows is not None:
            return config.gather_rows
        tokens = x_TH.shape[0]
        return gathers_rows_by_default(
            tokens=tokens,
            valid_rows=tokens * (config.top_k + shared_in_batch),
            capacity=self._device_routed.batch_capacity(tokens, shared_experts=shared_in_batch),
            num_experts=config.num_experts + shared_in_batch,
        )

    def _combines_atomically(self) -> bool:
        """Whether the fused path's down GEMM adds the rows into their tokens' rows in place of
        the combine kernel: config.atomic_combine, on a backend whose down GEMM can
        (cutedsl)."""
        return self.config.atomic_combine and getattr(self._expert_backend, "combines_rows", False)

    def _dispatches_fp8_rows(self) -> bool:
        """Whether the fused path's dispatch writes e4m3 rows (quantized as it copies the
        tokens) rather than bf16 rows the FP8 kernels quantize: FP8 weights on the cutedsl
        backend, a hidden size whose e4m3 rows the GEMM's TMA takes (a multiple of 16)."""
        return (
            self.config.weight_dtype == "fp8"
            and self._backend_name == "cutedsl"
            and self.config.hidden_size % 16 == 0
        )

    def forward(
        self,
        x: torch.Tensor,
        *,
        input_ids: torch.Tensor | None = None,
        return_router_logits: bool = False,
    ):
        """The MoE output of hidden states x [..., H] (the layer's activation dtype, its
        device), in x's shape; with return_router_logits, (output, router logits [T, E]), T
        the tokens of x. `input_ids` (integers, T of them, on x's device): the token ids whose
        rows of the routing table choose the experts of a layer that routes by token id
        (config.routing_table_vocab_size); other layers ignore them. Takes the fused path where
        fused_path_status says it runs, else the torch path (and always where autograd
        records); eager forwards of up to config.eager_graph_tokens tokens on the fused path
        replay the layer's own CUDA graphs.
        A sparsemixer layer refuses to train: training mode with gradients enabled
        (SPARSEMIXER_IN_TRAINING)."""
        if self._refuses_training and self.training and torch.is_grad_enabled():
            raise RuntimeError(SPARSEMIXER_IN_TRAINING)
        if (
            not torch.is_grad_enabled()
            and isinstance(x, torch.Tensor)
            and not torch.compiler.is_compiling()
        ):
            # the lean path: a forward of a shape this layer captured, replayed with no other
            # work (the checks below admitted it when it was captured)
            replayed = self._forward_graphs.replay(
                self,
                x,
                input_ids=self._graph_input_ids(input_ids),
                router_logits=return_router_logits,
            )
            if replayed is not None:
                return replayed if return_router_logits else replayed[0]
        self._check_input(x)
        if self.routing_table is not None:
            self._check_input_ids(input_ids, x)
        if self.config.check_inputs:
            if torch.compiler.is_compiling():
                torch._dynamo.graph_break(msg=CHECK_INPUTS_UNDER_COMPILE)
            if not bool(torch.isfinite(x).all()):
                raise ValueError("x holds NaN or Inf (check_inputs=True)")
        x_TH = x.reshape(-1, self.config.hidden_size)
        if not torch.compiler.is_compiling():  # the expert-compute ops resolve them as they run
            self._resolve_backend()
            self._resolve_dispatcher(x_TH)
        if self._replays_graphs(x_TH):
            # prepared first: a preparation may point w13/w2 into the prepared weights
            # (_point_routed_weights_into), and the graphs' key reads where they point
            self._prepared_weights()
            replayed = self._forward_graphs.forward(
                self,
                x,
                input_ids=self._graph_input_ids(input_ids),
                router_logits=return_router_logits,
            )
            if replayed is not None:
                return replayed if return_router_logits else replayed[0]
        runs_fused = self._runs_fused(x_TH)
        # traced under torch.compile: the custom op megamoe::fused_moe takes the logits
        router_logits_TE = self.router_logits(x_TH)
        if runs_fused and self._routes_on_this_gpu:
            if torch.compiler.is_compiling():
                # the routing, dispatch, experts, combine and shared experts: one op
                y_TH = fused_moe(
                    x_TH,
                    router_logits_TE,
                    self.w13,
                    self.w2,
                    self._fused_moe_weights(),
                    self._layer_id,
                )
            else:
                table_ids_TK = None
                if self.routing_table is not None:
                    table_ids_TK = self._table_ids(input_ids)
                y_TH = self._fused_forward(x_TH, router_logits_TE, table_ids_TK=table_ids_TK)
            y = self._normed(y_TH.view(x.shape))
            return (y, router_logits_TE) if return_router_logits else y
        if runs_fused and self.routing_table is None:  # expert parallelism
            if self.config.check_inputs:
                check_finite_logits(router_logits_TE)
            topk_ids_TK, topk_weights_TK = self._device_routed.route(
                router_logits_TE, correction_bias_E=self.e_score_correction_bias
            )
        elif self.routing_table is not None:
            if self.config.check_inputs:
                check_finite_logits(router_logits_TE)
            topk_ids_TK = self._table_ids(input_ids)
            topk_weights_TK = weights_of_chosen(router_logits_TE, topk_ids_TK, self.config.router)
            topk_ids_TK = topk_ids_TK.to(torch.int32)
        else:
            topk_ids_TK, topk_weights_TK = route(
                router_logits_TE,
                self.config.router,
                correction_bias_E=self.e_score_correction_bias,
                check_finite=self.config.check_inputs,
            )
        # the routed experts' rows: the tokens, or their latent projection
        rows_TH = x_TH if self.latent_in is None else self.latent_in(x_TH)
        if (
            torch.compiler.is_compiling()
            and not self._routes_on_this_gpu
            and not self._records_autograd(x_TH, topk_weights_TK)
        ):
            # the dispatcher exchanges data-dependent sizes with the other ranks: one opaque op
            y_TH = expert_parallel_mlp(
                rows_TH, topk_ids_TK, topk_weights_TK, self.w13, self.w2, self._layer_id
            )
        else:
            y_TH = self._dispatch_experts_combine(rows_TH, topk_ids_TK, topk_weights_TK)
        if self.latent_out is not None:
            y_TH = self.latent_out(y_TH)
        if self.shared_experts is not None:
            y_TH = y_TH + self.shared_experts(x_TH)
        y = self._normed(y_TH.reshape(x.shape).to(x.dtype))
        return (y, router_logits_TE) if return_router_logits else y

    def _normed(self, y: torch.Tensor) -> torch.Tensor:
        """The output through the output norm, where the layer has one."""
        return y if self.output_norm is None else self.output_norm(y)

    def routed_experts(
        self,
        x_TH: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        topk_weights_TK: torch.Tensor,
        *,
        expert_rows_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The routed experts' weighted sum [T, H] for tokens [T, H] routed elsewhere: each
        token's top-k experts (int, [T, K], in [0, E)) and weights ([T, K]), dispatched,
        computed and combined (no router, no shared experts, no output norm; transformers'
        experts interface, hf/experts_implementation.py). Where the fused path runs (one GPU,
        no autograd, not under torch.compile) one launch places the given experts and copies
        the rows, and one combines; else the torch path's dispatcher. `expert_rows_fn`: a
        row-wise function of the expert MLP's output rows [M, H], applied before the combine
        (transformers' post-expert norm). The ids are checked against E where
        config.check_inputs allows a host sync (unchecked, an id outside [0, E) on the fused
        path weighs 0)."""
        self._check_input(x_TH)
        if x_TH.dim() != 2 or topk_ids_TK.shape != (x_TH.shape[0], self.config.top_k):
            raise ValueError(
                f"x must be [tokens, H] and topk_ids [tokens, top_k={self.config.top_k}], got "
                f"{tuple(x_TH.shape)} and {tuple(topk_ids_TK.shape)}"
            )
        if topk_weights_TK.shape != topk_ids_TK.shape:
            raise ValueError(
                f"topk_weights must be shaped as topk_ids {tuple(topk_ids_TK.shape)}, got "
                f"{tuple(topk_weights_TK.shape)}"
            )
        if expert_rows_fn is not None and (
            self.config.num_identity_experts or self.config.routing_weights_on_input
        ):
            raise ValueError(
                "expert_rows_fn: rows of the expert MLP's output apart from identity experts "
                "and routing weights on the input"
            )
        if self.config.check_inputs:  # a host sync: only where check_inputs asks for it
            check_expert_ids(topk_ids_TK, self.config.num_experts)
        self._resolve_backend()
        self._resolve_dispatcher(x_TH)
        if (
            not torch.compiler.is_compiling()
            and self._routes_on_this_gpu
            and not self.config.num_identity_experts
            and not self._records_autograd(topk_weights_TK)
            and self._runs_fused(x_TH)
        ):
            return self._fused_routed_experts(
                x_TH, topk_ids_TK, topk_weights_TK, expert_rows_fn=expert_rows_fn
            )
        return self._dispatch_experts_combine(
            x_TH,
            topk_ids_TK.to(torch.int32),
            topk_weights_TK.float(),
            expert_rows_fn=expert_rows_fn,
        )

    def _fused_routed_experts(
        self,
        x_TH: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        topk_weights_TK: torch.Tensor,
        *,
        expert_rows_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """routed_experts on the fused path: the given experts placed and the rows copied (one
        launch), the expert MLP, the combine (one launch); the torch path's numbers."""
        x_TH = x_TH.contiguous()
        weights_on_input = self.config.routing_weights_on_input
        if topk_weights_TK.dtype not in (torch.float32, torch.bfloat16):
            topk_weights_TK = topk_weights_TK.float()
        topk_ids_TK = _int32_or_int64(topk_ids_TK)
        batch, handle, _ = self._device_routed.route_and_dispatch(
            x_TH,
            None,
            topk_ids_TK=topk_ids_TK,
            topk_weights_TK=topk_weights_TK,
            rows_dtype=torch.float8_e4m3fn if self._dispatches_fp8_rows() else None,
            gather_rows=self._gathers_rows(x_TH),
            weights_on_input=weights_on_input,
        )
        expert_out_MH = self._run_expert_backend(batch)
        if expert_rows_fn is not None:
            expert_out_MH = expert_rows_fn(expert_out_MH)
        return self._device_routed.combine(expert_out_MH, handle, weights_applied=weights_on_input)

    def _dispatch_experts_combine(
        self,
        x_TH: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        topk_weights_TK: torch.Tensor,
        *,
        expert_rows_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The routed experts' y_TH on the torch path: the dispatcher's batch, the expert MLP on
        it (its output rows through `expert_rows_fn` where given), the dispatcher's combine."""
        if self.config.num_identity_experts:
            return self._identity_combine(x_TH, topk_ids_TK, topk_weights_TK)
        batch, handle = self.dispatcher.dispatch(x_TH, topk_ids_TK, topk_weights_TK)
        if self.config.routing_weights_on_input:
            # each row is its routing weight times the token (in x's dtype, as Llama 4 does)
            row_weights_M1 = self.dispatcher.row_weights(batch, handle).unsqueeze(-1)
            batch = replace(batch, rows_MH=batch.rows_MH * row_weights_M1.to(batch.rows_MH.dtype))
            expert_out_MH = self._expert_compute(batch)
            return self.dispatcher.combine(expert_out_MH, handle, weights_applied=True)
        expert_out_MH = self._expert_compute(batch)
        if expert_rows_fn is not None:
            expert_out_MH = expert_rows_fn(expert_out_MH)
        return self.dispatcher.combine(expert_out_MH, handle)

    def _identity_combine(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> torch.Tensor:
        """_dispatch_experts_combine with identity experts: their pairs are dispatched as one
        more expert after the E routed ones, the expert MLP computes the routed experts' rows
        alone, and those pairs' rows keep their tokens, which the combine weighs as it weighs
        the experts' outputs (in the same fp32 order)."""
        experts = self.config.num_experts
        bucket_TK = topk_ids_TK.clamp(max=experts)  # every identity expert: bucket E
        batch, handle = self.dispatcher.dispatch(x_TH, bucket_TK, topk_weights_TK)
        offsets = batch.expert_offsets
        rows_M = torch.arange(batch.capacity, device=offsets.device, dtype=offsets.dtype)
        identity_M1 = (rows_M >= offsets[experts]).unsqueeze(-1)
        rows_MH = batch.rows_MH
        if rows_MH.requires_grad:
            # the expert MLP's gradient of rows past its valid ones is unspecified: the identity
            # rows take theirs from the combine alone
            rows_MH = torch.where(identity_M1, rows_MH.detach(), rows_MH)
        routed = replace(
            batch, rows_MH=rows_MH, expert_offsets=offsets[: experts + 1], valid_rows=None
        )
        expert_out_MH = self._expert_compute(routed)
        expert_out_MH = torch.where(
            identity_M1, batch.rows_MH.to(expert_out_MH.dtype), expert_out_MH
        )
        return self.dispatcher.combine(expert_out_MH, handle)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"x must have shape [..., hidden_size={self.config.hidden_size}], got {tuple(x.shape)}"
            )
        if x.dtype != self.activation_dtype:
            raise TypeError(f"x is {x.dtype} but the layer's weights are {self.activation_dtype}")
        if x.device != self.w13.device:
            raise ValueError(f"x is on {x.device} but the layer's weights are on {self.w13.device}")

    def _table_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T, top_k] int64: the routing table's experts for each token id (checked ids of any
        integer dtype: uint8 ones index the table too, where torch would take them as a
        mask)."""
        return self.routing_table[_int32_or_int64(input_ids.reshape(-1))]

    def _graph_input_ids(self, input_ids) -> torch.Tensor | None:
        """The token ids a graph of this forward takes: a layer routing by token id, its
        input_ids tensor (a key of the graphs; checked before any capture); other layers, None
        (they ignore the ids)."""
        if not self.config.routing_table_vocab_size or not isinstance(input_ids, torch.Tensor):
            return None
        return input_ids

    def _check_input_ids(self, input_ids: torch.Tensor | None, x: torch.Tensor) -> None:
        """input_ids of a layer that routes by token id: T integers on x's device (their
        values in [0, V) are checked where config.check_inputs allows a host sync)."""
        tokens = x.numel() // self.config.hidden_size
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(
                "this layer routes by token id (routing_table_vocab_size="
                f"{self.config.routing_table_vocab_size}): pass input_ids, a tensor of the "
                f"{tokens} tokens' ids, got {type(input_ids).__name__}"
            )
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integers, got {input_ids.dtype}")
        if input_ids.numel() != tokens or input_ids.device != x.device:
            raise ValueError(
                f"input_ids must hold one id per token of x ({tokens} on {x.device}), got "
                f"{tuple(input_ids.shape)} on {input_ids.device}"
            )
        if self.config.check_inputs:
            vocab = self.config.routing_table_vocab_size
            if tokens and not bool(((input_ids >= 0) & (input_ids < vocab)).all()):
                raise ValueError(f"input_ids must lie in [0, {vocab}) (check_inputs=True)")

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of the hidden states the layer takes and answers in: the constructor's
        `dtype`, converted with the weights by `.to(dtype)`, `.half()`, `.float()`, ... (the
        router's weight may stay fp32 and the experts' may be FP8)."""
        return self._activation_dtype

    def _apply(self, fn, recurse=True):
        # the conversion applied to every tensor (module.to, .half(), .cuda(), ...) says what it
        # makes of a floating tensor in the activations' dtype; an FP8 layer's e4m3 weights
        # must come out e4m3 (a cast without their scales would change every value)
        if self.config.weight_dtype == "fp8" or self.config.shared_weight_dtype == "fp8":
            cast = fn(torch.empty(0, dtype=FP8_WEIGHT_DTYPE)).dtype
            if cast != FP8_WEIGHT_DTYPE:
                raise TypeError(
                    f"this conversion would cast the layer's e4m3 weights to {cast} without "
                    f"their block scales; move it with .to(device) and build it (or from_hf) "
                    f"with the activations' dtype you want, or weight_dtype=None for {cast} "
                    f"weights"
                )
        super()._apply(fn, recurse)
        self._activation_dtype = fn(torch.empty(0, dtype=self._activation_dtype)).dtype
        return self

    def extra_repr(self) -> str:
        c = self.config
        shape = [
            f"experts={c.num_experts}",
            f"top_k={c.top_k}",
            f"hidden={c.hidden_size}",
            f"intermediate={c.intermediate_size}",
            f"scoring={c.scoring}",
            f"backend={c.backend}",
        ]
        if c.num_identity_experts:
            shape.append(f"identity_experts={c.num_identity_experts}")
        if c.activation != "swiglu":
            shape.append(f"activation={c.activation}")
        if c.latent_size is not None:
            shape.append(f"latent={c.latent_size}")
        if c.output_norm_eps is not None:
            shape.append(f"output_norm_eps={c.output_norm_eps:g}")
        if c.routing_table_vocab_size:
            shape.append(f"routing_table_vocab_size={c.routing_table_vocab_size}")
        if self.expert_parallel:
            shape.append(f"local_experts=[{self.local_experts.start}, {self.local_experts.stop})")
        return ", ".join(shape)
