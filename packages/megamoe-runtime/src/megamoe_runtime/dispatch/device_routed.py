"""Routing, dispatch and combine on one GPU as two device kernels (megamoe_kernels' local layer).

Shape legend: T tokens, E experts, K experts per token, H hidden size, M batch capacity.

`DeviceRoutedDispatcher.route_and_dispatch(x_TH, router_logits_TE)` is one launch: scoring,
(grouped) top-k, renormalisation and scaling, per-expert counts, `expert_offsets`, each
(token, k) pair's batch row and the expert-major copy of the tokens, in the order of
LocalDispatcher's stable sort. Against `route`: the same experts in the same order except
between equal scores (the kernel breaks ties towards the lower expert id, torch.topk in an
unspecified way), weights within an ulp or two (the softmax's sum is a warp tree); on the same
routing, the batch, offsets and pair rows are LocalDispatcher's bit for bit. `combine` is one
launch: the fixed-order fp32 weighted top-k sum of
`weighted_sum_over_topk`, with the shared experts' output added the way `y + shared` adds it in
bf16. `shared_experts=S` puts a shared MLP cut into S experts of the routed size into the batch
instead (experts E .. E + S - 1, every token's row in each, weight 1, after its routed pairs),
for the grouped GEMMs to compute with the routed experts; the combine then sums K + S pairs
(with `shared_gate_logits_T`, Qwen2-MoE's gated shared MLP, each token's shared pairs weigh
sigmoid of its gate logit in place of 1).
`weights_on_input=True` writes each batch row as its token times the pair's weight (the bits of
`x * w.to(torch.bfloat16)`) for experts that compute on w x (Llama 4), and `combine(...,
weights_applied=True)` then sums the rows unweighted. Given experts (`topk_ids_TK`, with their
weights given or scored from the logits) are placed in place of the routing's choice, for a model
that routes its tokens itself and for DeepSeek-V4's hash layers. No host sync, fixed shapes for a
fixed capacity: the pair captures in a CUDA graph.
Replaces about 25 torch launches of the routing (`route`), LocalDispatcher and its combine.
"""

from __future__ import annotations

import importlib.util

import torch
from megamoe_kernels.shim import knobs

from megamoe_runtime.dispatch.local import LocalHandle, row_weights_of
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.routing import RouterConfig


def route_launcher_constants(router: RouterConfig) -> dict:
    """The routing constants of megamoe_kernels' RouteLauncher for `router` (keyword
    arguments)."""
    return dict(
        num_experts=router.num_experts,
        top_k=router.top_k,
        scoring=router.scoring,
        renormalize=router.renormalize,
        num_groups=router.num_groups,
        top_groups=router.top_groups,
        group_score=router.group_score,
        choice_on_logits=router.choice_on_logits,
        sparsemixer_eps=router.sparsemixer_eps,
        routed_scaling_factor=router.routed_scaling_factor,
        dropped_group_score=router.dropped_group_score,
        has_correction_bias=router.use_correction_bias,
    )


def device_routing_status(
    router: RouterConfig, *, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[bool, str]:
    """(can run, why) for the device routing kernels with this router on `device`."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, f"the device routing kernels need an sm_90 CUDA GPU, got device {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return (
            False,
            f"the device routing kernels are built for sm_90a; this GPU is sm_{major}{minor}",
        )
    for module, package in (("cutlass", "nvidia-cutlass-dsl"), ("tvm_ffi", "apache-tvm-ffi")):
        if importlib.util.find_spec(module) is None:
            return False, f"{package} (import {module}) is not installed"
    if dtype != torch.bfloat16:
        return False, f"the device routing kernels move bf16 rows, got {dtype}"
    from megamoe_kernels.shim.local_layer import routing_problems

    problems = routing_problems(
        num_experts=router.num_experts,
        top_k=router.top_k,
        hidden_size=hidden_size,
        num_groups=router.num_groups,
    )
    if problems:
        return False, "; ".join(problems)
    return True, "sm_90 GPU with CuTe DSL: routing, dispatch and combine on the device"


def shared_experts_batch_problems(
    router: RouterConfig, *, hidden_size: int, shared_experts: int
) -> list[str]:
    """Why the device routing kernels cannot put `shared_experts` experts every token visits
    into the batch beside `router`'s ([] when they can): the experts and the pairs per token
    they hold."""
    from megamoe_kernels.shim.local_layer import routing_problems

    return routing_problems(
        num_experts=router.num_experts,
        top_k=router.top_k,
        hidden_size=hidden_size,
        num_groups=router.num_groups,
        shared_experts=shared_experts,
    )


def _row_major(tensor_TK: torch.Tensor | None) -> torch.Tensor | None:
    """[T, K] `tensor_TK` with strides (K, 1) and 16-byte aligned, as the kernels' compiled
    signatures take it (a contiguous tensor may have other strides: an empty one, a slice of
    one row; a slice may start anywhere): a copy where it is not."""
    if tensor_TK is None or (
        tensor_TK.stride() == (tensor_TK.shape[1], 1) and tensor_TK.data_ptr() % 16 == 0
    ):
        return tensor_TK
    return tensor_TK.new_empty(tensor_TK.shape).copy_(tensor_TK)


class DeviceRoutedDispatcher:
    """One GPU holding all the router's experts: route + dispatch in one launch, combine in one.

    `capacity` fixes the batch's row count (>= tokens x top_k, checked on the host from shapes)
    so shapes never change between calls, which CUDA-graph replay needs; None sizes each batch
    to exactly tokens x top_k. Compiles on first use per (logits dtype, device).
    `reuse_outputs`: a call writes the batch, ids, weights and pair rows into the buffers of the
    last call on this stream with the same shapes (shared by every dispatcher of the same
    routing constants) instead of allocating them: for a caller done with them once its own
    later launches on the stream have read them, as a layer's forward is.
    """

    def __init__(
        self,
        router: RouterConfig,
        *,
        hidden_size: int,
        capacity: int | None = None,
        reuse_outputs: bool = False,
    ):
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0 or None, got {capacity}")
        self.router = router
        self.hidden_size = hidden_size
        self.capacity = capacity
        self.reuse_outputs = reuse_outputs
        self.num_experts = self.num_local_experts = router.num_experts
        self._route_launchers: dict[tuple, object] = {}
        self._combine_launchers: dict[tuple, object] = {}

    def _route_launcher(
        self,
        logits_dtype: torch.dtype,
        device: torch.device,
        rows_dtype: torch.dtype = torch.bfloat16,
        gather_rows: bool = False,
        shared_experts: int = 0,
        weights_on_input: bool = False,
        shared_expert_gate: bool = False,
        publish_offsets: bool = False,
        given_ids_dtype: torch.dtype | None = None,
        given_weights_dtype: torch.dtype | None = None,
        row_tokens: bool = False,
    ):
        key = (
            logits_dtype,
            device,
            rows_dtype,
            gather_rows,
            shared_experts,
            weights_on_input,
            shared_expert_gate,
            publish_offsets,
            given_ids_dtype,
            given_weights_dtype,
            row_tokens,
        )
        launcher = self._route_launchers.get(key)
        if launcher is None:
            from megamoe_kernels.shim.local_layer import route_launcher

            launcher = self._route_launchers[key] = route_launcher(
                **route_launcher_constants(self.router),
                hidden_size=self.hidden_size,
                logits_dtype=logits_dtype,
                rows_dtype=rows_dtype,
                gather_rows=gather_rows,
                shared_experts=shared_experts,
                shared_expert_gate=shared_expert_gate,
                weights_on_input=weights_on_input,
                publish_offsets=publish_offsets,
                given_ids_dtype=given_ids_dtype,
                given_weights_dtype=given_weights_dtype,
                row_tokens=row_tokens,
                device=device,
            )
        return launcher

    def _correction_bias(self, correction_bias_E: torch.Tensor | None) -> torch.Tensor | None:
        """The bias the kernels take: float32 when the router uses one (refused if missing),
        else None."""
        if not self.router.use_correction_bias:
            return None
        if correction_bias_E is None:
            raise ValueError("the router uses a correction bias but no correction_bias_E was given")
        return (
            correction_bias_E
            if correction_bias_E.dtype == torch.float32
            else correction_bias_E.float()
        )

    def route_and_dispatch(
        self,
        x_TH: torch.Tensor,
        router_logits_TE: torch.Tensor | None,
        *,
        topk_ids_TK: torch.Tensor | None = None,
        topk_weights_TK: torch.Tensor | None = None,
        correction_bias_E: torch.Tensor | None = None,
        rows_dtype: torch.dtype | None = None,
        gather_rows: bool = False,
        shared_experts: int = 0,
        shared_gate_logits_T: torch.Tensor | None = None,
        weights_on_input: bool = False,
        token_count: torch.Tensor | None = None,
        reduce_into_TH: torch.Tensor | None = None,
    ) -> tuple[ExpertBatch, LocalHandle, torch.Tensor]:
        """(batch, handle for combine, topk_ids_TK int32); the routing weights are
        handle.topk_weights_TK (float32).

        `topk_ids_TK` (int32 or int64 [T, K]): the tokens' experts as given (a model that routes
        them itself; DeepSeek-V4's hash layers) in place of the routing's choice, placed in the
        same order; their weights `topk_weights_TK` (float32 or bfloat16 [T, K]) as given, with
        router_logits_TE None, or else each given expert's score from the logits, renormalised
        and scaled as the router's are (weights_of_chosen). An id outside [0, E) is placed as
        expert 0 with weight 0 (nothing outside the batch is touched); check_expert_ids checks
        them where a host sync is affordable.

        `shared_experts=S`: the batch holds E + S experts, the last S visited by every token
        with weight 1 (the ids, weights and pair rows then have K + S columns); `capacity`,
        which counts the routed rows, grows by capacity / K rows per shared expert
        (batch_capacity). `shared_gate_logits_T` (float32 [T], with S > 0): the logit of a
        sigmoid gate on the shared MLP (Qwen2-MoE's), each token's shared pairs then weighing
        sigmoid(logit) instead of 1.

        `rows_dtype=torch.float8_e4m3fn`: the kernel quantizes each bf16 token as it copies it
        into its top-k rows, so the batch holds e4m3 rows and row_scales_GM (one scale per row
        and 128 columns), the bits megamoe_kernels.quantize_rows gives each batch row, for half
        the bytes of bf16 rows and no pass over the tokens before the dispatch. None: the
        tokens' dtype.

        `gather_rows=True` (bf16 tokens): no row is copied; the batch is gathered
        (ExpertBatch.gathered: the tokens and the token of each batch row), for a backend whose
        gate-up GEMM reads the rows from the tokens (cutedsl; the others copy them out).

        A call of at most megamoe_kernels' knobs.GATE_UP_POLLS_OFFSETS_MAX_TOKENS tokens (one)
        publishes the batch's offsets before its launch ends (`offsets_published`), for the
        decode gate-up GEMM to start its weights then.

        `weights_on_input=True` (bf16 rows, copied): each pair's row is its token times the
        pair's weight, x * w.to(torch.bfloat16) bit for bit, for experts that compute on w x
        (Llama 4); combine the outputs with weights_applied=True. Refused with e4m3 rows and
        with gather_rows, which copy no bf16 row.

        `token_count` (int32 [1] on x's device): only the first min(count, T) tokens are routed,
        placed and copied, and the combine of the handle sums only theirs (its output's rows
        past them are left as they are): a CUDA graph captured for T token rows serves any
        count up to T. The ids', weights' and pair rows' entries past it are unspecified, the
        batch's valid rows are expert_offsets[-1] (its valid_rows, T x pairs, an upper bound).

        `reduce_into_TH` (bf16 [T, H], contiguous): the output a down GEMM adds the batch rows
        into in place of `combine` (the cutedsl backend's row_tokens_M): the launch zeroes its
        (counted) tokens' rows and writes each batch row's token and its pair's weight
        (handle.row_tokens_M, row_weights_M)."""
        if weights_on_input and (gather_rows or rows_dtype not in (None, torch.bfloat16)):
            raise ValueError(
                f"weights_on_input=True writes scaled bf16 rows: it takes gather_rows=False and "
                f"rows_dtype None or torch.bfloat16, got gather_rows={gather_rows}, "
                f"rows_dtype={rows_dtype}"
            )
        if shared_gate_logits_T is not None and not shared_experts:
            raise ValueError(
                "shared_gate_logits_T gates shared experts in the batch: pass shared_experts >= 1"
            )
        if topk_weights_TK is not None and topk_ids_TK is None:
            raise ValueError("topk_weights_TK weighs given experts: pass topk_ids_TK too")
        if (router_logits_TE is None) != (topk_weights_TK is not None):
            raise ValueError(
                "router_logits_TE is None exactly where topk_weights_TK gives the weights, got "
                f"router_logits_TE {'None' if router_logits_TE is None else 'given'} and "
                f"topk_weights_TK {'None' if topk_weights_TK is None else 'given'}"
            )
        tokens = x_TH.shape[0]
        num_pairs = tokens * (self.router.top_k + shared_experts)
        capacity = self.batch_capacity(tokens, shared_experts=shared_experts)
        rows_dtype = x_TH.dtype if rows_dtype is None else rows_dtype
        launcher = self._route_launcher(
            torch.float32 if router_logits_TE is None else router_logits_TE.dtype,
            x_TH.device,
            rows_dtype,
            gather_rows,
            shared_experts,
            weights_on_input,
            shared_gate_logits_T is not None,
            knobs.routing_publishes_offsets(tokens),
            None if topk_ids_TK is None else topk_ids_TK.dtype,
            None if topk_weights_TK is None else topk_weights_TK.dtype,
            reduce_into_TH is not None,
        )
        routed = launcher(
            router_logits_TE,
            x_TH,
            capacity=capacity,
            # the bias only chooses experts: given ones take none
            correction_bias_E=None
            if topk_ids_TK is not None
            else self._correction_bias(correction_bias_E),
            shared_gate_T=shared_gate_logits_T,
            topk_ids_TK=_row_major(topk_ids_TK),
            topk_weights_TK=_row_major(topk_weights_TK),
            token_count=token_count,
            reuse_outputs=self.reuse_outputs,
            out_TH=reduce_into_TH,
        )
        published = launcher.publishes_offsets
        if gather_rows:
            batch = ExpertBatch.gathered(
                x_TH,
                routed.row_source_M,
                routed.expert_offsets,
                valid_rows=num_pairs,
                offsets_published=published,
            )
        else:
            batch = ExpertBatch(
                rows_MH=routed.rows_MH,
                expert_offsets=routed.expert_offsets,
                valid_rows=num_pairs,
                row_scales_GM=routed.row_scales_GM,
                offsets_published=published,
            )
        handle = LocalHandle(
            row_of_pair_TK=routed.row_of_pair_TK,
            topk_weights_TK=routed.topk_weights_TK,
            output_dtype=x_TH.dtype,
            token_count=token_count,
            row_tokens_M=None if reduce_into_TH is None else routed.row_source_M,
            row_weights_M=routed.row_weights_M,
        )
        return batch, handle, routed.topk_ids_TK

    def batch_capacity(self, tokens: int, *, shared_experts: int = 0) -> int:
        """Rows of the batch of a call of `tokens`: tokens x (K + S) without a capacity, else
        the capacity (rows for the routed pairs) and, for S shared experts in the batch, room
        for as many tokens as the capacity has routed rows for: ceil(capacity / K) rows each
        (a call within the capacity stays within it)."""
        top_k = self.router.top_k
        if self.capacity is None:
            return tokens * (top_k + shared_experts)
        return self.capacity + shared_experts * -(-self.capacity // top_k)

    def route(
        self, router_logits_TE: torch.Tensor, *, correction_bias_E: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids_TK int32, topk_weights_TK float32) alone, one launch (no placement): the
        routing an expert-parallel dispatcher takes in place of `route`'s torch ops."""
        launcher = self._route_launcher(router_logits_TE.dtype, router_logits_TE.device)
        return launcher.route(
            router_logits_TE,
            correction_bias_E=self._correction_bias(correction_bias_E),
        )

    def row_weights(self, batch: ExpertBatch, handle: LocalHandle) -> torch.Tensor:
        """Routing weight of every batch row (RowWeightsDispatcher)."""
        return row_weights_of(batch, handle)

    def combine(
        self,
        expert_out_MH: torch.Tensor,
        handle: LocalHandle,
        *,
        addend_TH: torch.Tensor | None = None,
        weights_applied: bool = False,
        out_TH: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y[t] = sum over k of weight[t, k] x expert_out[row[t, k]] (+ addend[t]), bf16; k
        over the handle's pairs (top_k, and the shared experts in the batch). Written into
        `out_TH` ([T, hidden], contiguous, the rows' dtype) where given."""
        pairs = handle.row_of_pair_TK.shape[1]
        key = (not weights_applied, addend_TH is not None, expert_out_MH.device, pairs)
        launcher = self._combine_launchers.get(key)
        if launcher is None:
            from megamoe_kernels.shim.local_layer import combine_launcher

            launcher = self._combine_launchers[key] = combine_launcher(
                top_k=pairs,
                hidden_size=self.hidden_size,
                weighted=not weights_applied,
                has_addend=addend_TH is not None,
                dtype=expert_out_MH.dtype,
                device=expert_out_MH.device,
            )
        return launcher(
            expert_out_MH,
            handle.row_of_pair_TK,
            None if weights_applied else handle.topk_weights_TK,
            addend_TH=addend_TH,
            out_TH=out_TH,
            token_count=handle.token_count,
        )
