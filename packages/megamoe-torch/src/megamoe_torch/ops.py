"""torch.library custom ops: the layer's expert compute as one opaque op, so torch.compile traces
the whole forward around it with no graph break.

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

Layers register themselves at construction (`register_layer`), held weakly.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from megamoe_kernels import fresh_scratch
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
