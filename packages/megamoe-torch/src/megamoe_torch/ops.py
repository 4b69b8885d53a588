"""torch.library custom ops: the layer's device work as opaque ops, so torch.compile traces the
whole forward around them with no graph break.

`megamoe::expert_mlp(rows_MH, expert_offsets, w13_E2IH, w2_EHI, layer_id, valid_rows,
expert_counts)` runs the expert MLP of the MegaMoE registered under `layer_id` on an expert-major
batch (tight, or masked when `expert_counts` is given), on that layer's
backend and its prepared weights (the layer's own cache: the backend's weight layout is built
once per weight version, outside any graph). Its fake implementation gives dynamo and inductor
the output's shape ([M, H], the rows' dtype) without running anything; the weights are inputs so
the graph records that the op reads them. Inside, the backends read `expert_offsets` on the host
(the reference oracle) or launch CuTe DSL / grouped GEMM kernels: none of that is traced.

`megamoe::expert_parallel_mlp(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, layer_id)`
is the same for a layer whose experts live on several ranks (or behind a dispatcher the caller
brought, e.g. DeepEP): the dispatch of each token to its experts' ranks, the expert MLP of this
rank's experts and the combine back, y_TH, as one op. Those steps exchange counts and rows
whose sizes only the other ranks know (the torch dispatcher syncs them to the host), so no
shape inside is static; the op's answer is [T, H] in x's dtype, which its fake implementation
gives. Inside it runs the layer's dispatcher and backend as an eager forward does.

`megamoe::fused_moe(x_TH, router_logits_TE, w13_E2IH, w2_EHI, other_weights, layer_id)` is the
fused path of a layer on one GPU after its router: the routing and dispatch launch, the expert
GEMMs, the combine launch and the shared experts (in the batch or on a side stream), y_TH [T, H]
in x's dtype, as `MegaMoE._fused_forward` runs them eagerly. Its fake implementation gives that
shape; no host sync inside, so inductor's CUDA graphs (mode="reduce-overhead") capture it.
`other_weights` lists every other tensor of the layer the op reads (below, `fused_moe`).

`megamoe::router_logits(x_TH, weight_EH, bias_E, logits_dtype)` is the router-logits kernel
(megamoe_kernels.RouterLogitsLauncher) as an op, so a compiled decode forward computes the
router logits with the kernel an eager one launches: the same bits on both. Eager forwards call
the kernel directly (`router_kernel`), without the op's dispatch.

Layers register themselves at construction (`register_layer`), held weakly.
"""

from __future__ import annotations

import importlib.util
import itertools
import weakref

import torch
from megamoe_kernels import fresh_scratch, router_logits_launcher, router_logits_problems
from megamoe_runtime.expert_batch import ExpertBatch

_LAYERS: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count()


def register_layer(layer: torch.nn.Module) -> int:
    """An id under which the ops find `layer` (held weakly)."""
    layer_id = next(_NEXT_ID)
    _LAYERS[layer_id] = layer
    return layer_id


def _layer(op: str, layer_id: int) -> torch.nn.Module:
    layer = _LAYERS.get(layer_id)
    if layer is None:
        raise RuntimeError(f"megamoe::{op}: no live MegaMoE layer has id {layer_id}")
    return layer


@torch.library.custom_op("megamoe::expert_mlp", mutates_args=())
def expert_mlp(
    rows_MH: torch.Tensor,
    expert_offsets: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    layer_id: int,
    valid_rows: int,
    expert_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """expert_out_MH of layer `layer_id`'s backend; `valid_rows` < 0: known on the device only;
    `expert_counts`: the masked layout's counts (None: a tight batch)."""
    layer = _layer("expert_mlp", layer_id)
    batch = ExpertBatch(
        rows_MH=rows_MH,
        expert_offsets=expert_offsets,
        valid_rows=None if valid_rows < 0 else valid_rows,
        expert_counts=expert_counts,
    )
    layer._resolve_backend()
    # a compiled graph's call keeps nothing past itself (CUDA-graph trees allocate its warm-up
    # from their pool and refuse pool memory that outlives the call)
    with fresh_scratch():
        return layer._run_expert_backend(batch)  # a fresh tensor: it aliases nothing


@expert_mlp.register_fake
def _expert_mlp_fake(
    rows_MH, expert_offsets, w13_E2IH, w2_EHI, layer_id, valid_rows, expert_counts=None
):
    return rows_MH.new_empty(rows_MH.shape)


@torch.library.custom_op("megamoe::expert_parallel_mlp", mutates_args=())
def expert_parallel_mlp(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    layer_id: int,
) -> torch.Tensor:
    """y_TH of layer `layer_id`'s routed experts: dispatch to the experts' ranks, this rank's
    expert MLP, combine (the shared experts are not in it)."""
    layer = _layer("expert_parallel_mlp", layer_id)
    layer._resolve_dispatcher(x_TH)
    layer._resolve_backend()
    with fresh_scratch():
        y_TH = layer._dispatch_experts_combine(x_TH, topk_ids_TK, topk_weights_TK)
    return y_TH.to(x_TH.dtype)


@expert_parallel_mlp.register_fake
def _expert_parallel_mlp_fake(x_TH, topk_ids_TK, topk_weights_TK, w13_E2IH, w2_EHI, layer_id):
    return x_TH.new_empty(x_TH.shape)


@torch.compiler.assume_constant_result
def fused_path_runs(layer_id: int, device: torch.device) -> bool:
    """fused_path_status(device)[0] of layer `layer_id`, run as it is (not traced) when dynamo
    traces a forward: a host check, cached per device and activation dtype, whose first call
    reads the GPU's capability and the installed packages, which dynamo cannot trace in every
    torch version. Fixed for a compiled graph: dynamo guards the input's device and dtype."""
    return _layer("fused_moe", layer_id).fused_path_status(device)[0]


@torch.library.custom_op("megamoe::fused_moe", mutates_args=())
def fused_moe(
    x_TH: torch.Tensor,
    router_logits_TE: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    other_weights: list[torch.Tensor],
    layer_id: int,
) -> torch.Tensor:
    """y_TH of layer `layer_id`'s fused path from its router logits: routing and dispatch, the
    routed experts, the combine, plus the shared experts.

    The op reads the layer's tensors through the layer, not through its arguments, and a graph
    sees only the arguments: it orders the op after a write to them, and inductor's CUDA graphs
    record again when one is another tensor (a replaced weight), where a replay would read one
    it never saw at its old address. So `other_weights` holds all the others the forward reads
    (MegaMoE._fused_moe_weights: block scales, expert biases, the correction bias the routing
    kernel reads, the shared experts' weights), not only the routed weights expert_mlp takes."""
    layer = _layer("fused_moe", layer_id)
    layer._resolve_backend()
    # the routing kernel reads row-major logits whatever layout the graph gave them (a no-op
    # for the router's own)
    router_logits_TE = router_logits_TE.contiguous()
    # nothing kept past the call (as in expert_mlp): the routing's outputs and the GEMMs'
    # scratch are made anew, in the CUDA-graph trees' pool under mode="reduce-overhead"
    with fresh_scratch():
        # the combine's output: a fresh tensor in x's dtype (bf16), aliasing nothing
        return layer._fused_forward(x_TH, router_logits_TE)


@fused_moe.register_fake
def _fused_moe_fake(x_TH, router_logits_TE, w13_E2IH, w2_EHI, other_weights, layer_id):
    return x_TH.new_empty(x_TH.shape)


# the router-logits kernel per (E, H, logits dtype, bias dtype, device); None where it cannot run
_ROUTER_KERNELS: dict[tuple, object] = {}


def router_kernel(
    num_experts: int,
    hidden_size: int,
    logits_dtype: torch.dtype,
    bias_dtype: torch.dtype | None,
    device: torch.device,
):
    """The router-logits kernel (a RouterLogitsLauncher) for this router on `device`, or None
    where it cannot run there: not an sm_90 GPU, CuTe DSL or tvm-ffi not installed, or a router
    it does not take (router_logits_problems). Kept per arguments: one lookup a call."""
    key = (num_experts, hidden_size, logits_dtype, bias_dtype, device)
    launcher = _ROUTER_KERNELS.get(key, False)
    if launcher is False:
        constants = dict(
            num_experts=num_experts,
            hidden_size=hidden_size,
            logits_dtype=logits_dtype,
            bias_dtype=bias_dtype,
        )
        runs = (
            device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0)
            and all(importlib.util.find_spec(module) for module in ("cutlass", "tvm_ffi"))
            and not router_logits_problems(**constants)
        )
        launcher = router_logits_launcher(**constants, device=device) if runs else None
        _ROUTER_KERNELS[key] = launcher
    return launcher


@torch.compiler.assume_constant_result
def router_kernel_runs(
    num_experts: int,
    hidden_size: int,
    logits_dtype: torch.dtype,
    bias_dtype: torch.dtype | None,
    device: torch.device,
) -> bool:
    """router_kernel(...) is not None, run as it is when dynamo traces a forward (a host check
    that reads the GPU's capability and the installed packages)."""
    return router_kernel(num_experts, hidden_size, logits_dtype, bias_dtype, device) is not None


@torch.library.custom_op("megamoe::router_logits", mutates_args=())
def router_logits(
    x_TH: torch.Tensor,
    weight_EH: torch.Tensor,
    bias_E: torch.Tensor | None,
    logits_dtype: torch.dtype,
) -> torch.Tensor:
    """logits_TE = x_TH weight_EH^T (+ bias_E) by the router-logits kernel, in logits_dtype."""
    bias_dtype = None if bias_E is None else bias_E.dtype
    launcher = router_kernel(*weight_EH.shape, logits_dtype, bias_dtype, x_TH.device)
    if launcher is None:
        raise RuntimeError(
            f"megamoe::router_logits: the router-logits kernel cannot run this router on "
            f"{x_TH.device} (weight {tuple(weight_EH.shape)}, logits {logits_dtype}, bias "
            f"{bias_dtype}): check router_kernel_runs first"
        )
    return launcher(x_TH.contiguous(), weight_EH, bias_E=bias_E)


@router_logits.register_fake
def _router_logits_fake(x_TH, weight_EH, bias_E, logits_dtype):
    return x_TH.new_empty((x_TH.shape[0], weight_EH.shape[0]), dtype=logits_dtype)
