"""Stable API of the one-GPU routing, dispatch and combine kernels (drop/local_route.py,
drop/local_combine.py): checks, compile cache, launches.

Shape legend: T tokens, E experts, K experts per token (top-k), H hidden size, M batch rows
(capacity).

- `RouteLauncher` (`route_launcher(...)`): router logits [T, E] and tokens x [T, H] in, one
  launch out: topk_ids [T, K] int32, topk_weights [T, K] float32, row_of_pair [T, K] int32 (the
  batch row of pair (t, k): the order of a stable sort of the flattened ids by expert),
  expert_offsets [E + 1] int32 and the expert-major batch rows [M, H] (rows past T x K
  unspecified). With `shared_experts=S` every token also visits experts E .. E + S - 1 with
  weight 1 (a shared MLP cut into S experts of the routed size, computed by the same grouped
  GEMMs): K + S pairs per token in those tensors, E + S + 1 offsets; with
  `shared_expert_gate=True` the shared pairs' weight is sigmoid of each token's gate logit
  (shared_gate_T [T] float32, Qwen2-MoE's gate on its shared MLP) in place of 1. The rows:
  bf16, or with rows_dtype=e4m3 the rows quantized as they are copied, with
  their scales [ceil(H / 128), M] float32 (shim/fp8.py's layout and values); or with
  gather_rows=True no rows at all but row_source [M] int32, the token of each batch row, for a
  gate-up GEMM that reads the rows from the tokens (gate_up_swiglu's row_source_M); or with
  weights_on_input=True (bf16, copied) each pair's row scaled by its routing weight, the bits of
  `x * w.to(torch.bfloat16)`, for experts that compute on w x (Llama 4), combined unweighted.
  With row_tokens=True the launch also writes row_source [M] int32 (each batch row's token;
  also where the rows are copied) and row_weights [M] float32 (its pair's weight), and zeroes
  the rows of the call's out_TH [T, H] bf16, for a down GEMM that adds its rows into them in
  place of the combine (down's row_source_M and row_scale_M).
  Every routing of megamoe's RouterConfig: softmax, sigmoid or sqrt(softplus) scoring, a
  correction bias on the scores or the logits for the choice, grouped top-k (groups scored by
  their two best experts or their best), PhiMoE's sparsemixer, renormalisation, routed scaling.
  Given experts (`given_ids_dtype` int32 or int64): the launch places each token's top-k experts
  as the caller gives them (topk_ids_TK, a model that routes its tokens itself) with their
  weights as given (`given_weights_dtype` float32 or bfloat16, no logits) or scored from the
  logits (DeepSeek-V4's hash layers: each given expert's score, renormalised and scaled); an
  expert named twice in a token keeps both pairs, in k order; an id outside [0, E) is placed as
  expert 0 with weight 0, so that it reaches no memory outside the batch.
  `RouteLauncher.route(logits)`: the routing alone (ids and weights, one launch), for the
  expert-parallel dispatchers. With `publish_offsets` (the caller's choice for the call's size:
  knobs.routing_publishes_offsets) expert_offsets is a view of E + S + 2 words whose last the
  kernel sets to 1 once the offsets are final, before it ends, for a gate-up GEMM that polls
  for them (gate_up_swiglu's offsets_published).
- `CombineLauncher` (`combine_launcher(...)`): y[t] = sum over k in order of weight[t, k] x
  out[row_of_pair[t, k]] in fp32 (+ an optional addend row), bf16 out; no atomics.

Both are compiled for CuTe DSL's TVM-FFI launch path (torch tensors passed as they are, checked
against the compiled signature in C, launched on torch's current stream, so CUDA graphs capture
them), once per (routing or combine constants, hidden size, dtypes, device); T and M are
dynamic dims. The routing kernel's scratch (grid-barrier words, zeroed once, left as found) is
kept per (device, stream), as the GEMMs' counters are.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

from megamoe_kernels.shim.ep import copy_unroll
from megamoe_kernels.shim.expert_gemm import (
    _current_stream_handle,
    _persistent_ctas,
    _stream_scratch,
    keeps_buffers,
    published_offsets_buffer,
)

_COMPILE_LOCK = threading.Lock()
_COMPILED: dict[tuple, Callable] = {}
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus", "sparsemixer")
GROUP_SCORES = ("top2_sum", "max")
# the experts and weights a caller may give in place of the routing's choice
GIVEN_IDS_DTYPES = (torch.int32, torch.int64)
GIVEN_WEIGHTS_DTYPES = (torch.float32, torch.bfloat16)
LOGITS_DTYPES = (torch.float32, torch.bfloat16)
# the batch rows the routing kernel writes: the tokens' bf16, or e4m3 quantized as they copy
ROW_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
# a grid-barrier wait longer than this records a timeout in the status block and carries on
_BARRIER_TIMEOUT_NS = 10_000_000_000
# the routing kernel's rows one CTA copies at most (_one_cta_tokens)
_ONE_CTA_COPY_BYTES = 256 << 10
# e4m3 rows: the default unroll leaves a row at least this many slices of 32 x unroll vectors
QUANTIZED_ROW_SLICES = 4


class RouteOutputs(NamedTuple):
    """What a routing launch writes (RouteLauncher.__call__), in the order the kernel takes
    them after x. A field the launcher was not built for is None."""

    topk_ids_TK: torch.Tensor
    """int32 [T, pairs]: each pair's expert (pairs = K + the shared experts in the batch)."""
    topk_weights_TK: torch.Tensor
    """float32 [T, pairs]: each pair's weight."""
    row_of_pair_TK: torch.Tensor
    """int32 [T, pairs]: each pair's row of the expert-major batch."""
    expert_offsets: torch.Tensor
    """int32: the batch's E + S + 1 expert offsets (with publishes_offsets, the word they are
    published in follows them)."""
    rows_MH: torch.Tensor | None
    """[capacity, H] the copied rows (bf16 or e4m3); None when the GEMM gathers them."""
    row_scales_GM: torch.Tensor | None
    """float32 [H / 128, capacity] the e4m3 rows' scales; None for bf16 rows."""
    row_source_M: torch.Tensor | None
    """int32 [capacity] each row's token; None unless gathering or row_tokens."""
    row_weights_M: torch.Tensor | None
    """float32 [capacity] each row's pair weight; None unless row_tokens."""


def _drop_route():
    if not torch.cuda.is_available():
        # without a GPU CuTe DSL guesses another architecture; set before it is imported
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from megamoe_kernels.drop import local_route

    return local_route


def combine_residency(top_k: int) -> tuple[int, int]:
    """(threads a CTA, CTAs resident per SM) that the combine kernel's launch bounds hold for
    `top_k` pairs a token: its grid is one wave of them."""
    _drop_route()  # sets the architecture without a GPU
    from megamoe_kernels.drop.local_combine import COMBINE_THREADS, combine_ctas_per_sm

    return COMBINE_THREADS, combine_ctas_per_sm(top_k)


def route_residency(batch_experts: int, quantizes: bool) -> tuple[int, int]:
    """(threads a CTA, CTAs resident per SM) that route_and_place's launch bounds hold for
    `batch_experts` experts (routed and shared) and bf16 or quantized rows: its grid, all
    resident for its barriers, is at most that many CTAs on each SM."""
    route = _drop_route()
    return route.ROUTE_THREADS, route.route_ctas_per_sm(batch_experts, quantizes)


def routing_problems(
    *,
    num_experts: int,
    top_k: int,
    hidden_size: int,
    num_groups: int = 1,
    shared_experts: int = 0,
) -> list[str]:
    """Why the routing and combine kernels cannot serve this layer ([] when they can);
    `shared_experts`: the experts every token visits besides its top_k (RouteLauncher)."""
    from megamoe_kernels.drop.local_route import ROUTE_MAX_EXPERTS, ROUTE_MAX_TOP_K

    problems = []
    if not 1 <= num_experts <= ROUTE_MAX_EXPERTS - shared_experts:
        problems.append(
            f"num_experts={num_experts} is outside [1, {ROUTE_MAX_EXPERTS - shared_experts}]"
            + (f" (with {shared_experts} shared experts)" if shared_experts else "")
        )
    if not 1 <= top_k <= min(ROUTE_MAX_TOP_K - shared_experts, num_experts):
        problems.append(
            f"top_k={top_k} is outside [1, min({ROUTE_MAX_TOP_K - shared_experts}, num_experts)]"
            + (f" (with {shared_experts} shared experts)" if shared_experts else "")
        )
    if shared_experts < 0:
        problems.append(f"shared_experts={shared_experts} is negative")
    if hidden_size % 8:
        problems.append(f"hidden_size={hidden_size} is not a multiple of 8 (16-byte row vectors)")
    if num_groups > 32:
        problems.append(f"num_groups={num_groups} exceeds 32")
    return problems


def _one_cta_tokens(top_k: int, hidden_size: int, *, copies: bool = True) -> int:
    """Up to how many tokens the routing kernel runs as one CTA (no grid barrier, but one SM
    copies every row): while their rows total at most _ONE_CTA_COPY_BYTES, or the most a CTA
    routes (a warp per token) when it copies no rows. Measured at qwen3-30b-a3b (4 KB rows,
    top-8; scripts/layer_kernels.py --route-ab): one CTA 7.4 us at 4 tokens and 16.8 at 16, the
    grid 10.0 and 10.5."""
    if not copies:
        return 16
    return max(1, min(16, _ONE_CTA_COPY_BYTES // (top_k * hidden_size * 2)))


def _quantizing_cta_tokens(row_vectors: int, unroll: int, warps: int) -> int:
    """The tokens a CTA takes where its warps split their e4m3 rows' quantizing copies (slices
    of 32 x unroll 16-byte vectors, whole quantization groups): as many as give each warp one
    slice, at least one. Where a warp per token left one or two SMs quantizing every row, the
    FP8 layer on the H200 took 6% less time at 16 dsv3-ep8-local tokens (170.5-170.8 -> 160.2
    us), 3-4% less at 128 tokens of dsv3-ep8-local and qwen3-30b-a3b, 0.6-2% at 16 and 128 of
    mixtral-8x7b; at 4 dsv3-ep8-local tokens a grid of 2 CTAs lost 2.4% to one CTA taking two
    passes (docs/benchmarks.md, "Quantizing copies a pass per CTA")."""
    slices = -(-row_vectors // (32 * unroll))
    return max(1, warps // slices)


def _device_index(device: torch.device | None, compile_only: bool) -> int:
    """The GPU a launcher compiles for, whose SMs size its grids: the device's index (the
    current device for a bare "cuda" or no device), or -1 for none (compile_only, no GPU or
    a device that is not one: the default SM count)."""
    not_a_gpu = device is not None and device.type != "cuda"
    if compile_only or not_a_gpu or not torch.cuda.is_available():
        return -1
    if device is None or device.index is None:
        return torch.cuda.current_device()
    return device.index


def _cutlass_dtype(dtype: torch.dtype):
    import cutlass

    return {
        torch.float32: cutlass.Float32,
        torch.bfloat16: cutlass.BFloat16,
        torch.float8_e4m3fn: cutlass.Float8E4M3FN,
        torch.int32: cutlass.Int32,
        torch.int64: cutlass.Int64,
    }[dtype]


class RouteLauncher:
    """Routing + dispatch of one layer's routing constants, compiled on first use; a call
    allocates (or reuses) the outputs and launches one kernel. See the module docstring for the
    tensors. The routing constants are RouterConfig's (megamoe_runtime.routing), with
    `has_correction_bias` for its use_correction_bias (the bias is the call's tensor);
    `copy_by_token`, `one_cta_tokens`, `unroll`, `split_tokens` and `cta_tokens` are
    the kernel's knobs (docs/kernels-design.md). `unroll`: the 16-byte loads a lane keeps in
    flight as it copies or quantizes a row, 1, 2, 4 or 8 with 32 x unroll vectors dividing the
    row (None: the largest, copy_unroll; for e4m3 rows the largest that leaves a row at least
    QUANTIZED_ROW_SLICES slices). `split_tokens`: a CTA of fewer tokens than this has all its
    warps share its rows' copies in slices of 32 x unroll vectors (0: never; None: ROUTE_WARPS
    where a row holds more than one slice, else 0). `cta_tokens`: the most tokens a CTA of a
    grid takes where the grid has room, 1 to ROUTE_WARPS (None: for e4m3 rows split between
    the warps, as many as fill the warps with slices once, _quantizing_cta_tokens; else
    ROUTE_WARPS, a warp per token); `one_cta_tokens` (None: _one_cta_tokens) is at most twice
    it. `publish_offsets`: the offsets are published in the word after them before the kernel
    ends (the module docstring); `publishes_offsets` says whether they are."""

    def __init__(
        self,
        *,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        scoring: str = "softmax",
        renormalize: bool = True,
        num_groups: int = 1,
        top_groups: int = 1,
        group_score: str = "top2_sum",
        choice_on_logits: bool = False,
        sparsemixer_eps: float = 0.01,
        routed_scaling_factor: float = 1.0,
        dropped_group_score: float = float("-inf"),
        has_correction_bias: bool = False,
        logits_dtype: torch.dtype = torch.float32,
        rows_dtype: torch.dtype = torch.bfloat16,
        gather_rows: bool = False,
        shared_experts: int = 0,
        shared_expert_gate: bool = False,
        weights_on_input: bool = False,
        row_tokens: bool = False,
        copy_by_token: bool = True,
        one_cta_tokens: int | None = None,
        unroll: int | None = None,
        split_tokens: int | None = None,
        cta_tokens: int | None = None,
        publish_offsets: bool = False,
        given_ids_dtype: torch.dtype | None = None,
        given_weights_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        compile_only: bool = False,
    ):
        problems = routing_problems(
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=hidden_size,
            num_groups=num_groups,
            shared_experts=shared_experts,
        )
        if scoring not in SCORINGS:
            problems.append(f"scoring={scoring!r} is not one of {SCORINGS}")
        if shared_expert_gate and shared_experts < 1:
            problems.append(
                "shared_expert_gate=True gates shared experts: it needs shared_experts >= 1"
            )
        if group_score not in GROUP_SCORES:
            problems.append(f"group_score={group_score!r} is not one of {GROUP_SCORES}")
        if scoring == "sparsemixer" and (
            top_k != 2 or has_correction_bias or num_groups > 1 or choice_on_logits
        ):
            problems.append(
                "scoring='sparsemixer' chooses two experts on the logits alone (top_k=2, no "
                "correction bias, no groups, not choice_on_logits)"
            )
        if num_groups < 1 or num_experts % num_groups or not 1 <= top_groups <= num_groups:
            problems.append(
                f"num_groups={num_groups} must divide num_experts={num_experts} and "
                f"top_groups={top_groups} lie in [1, num_groups]"
            )
        if logits_dtype not in LOGITS_DTYPES:
            problems.append(f"logits dtype {logits_dtype} is not one of {LOGITS_DTYPES}")
        if given_ids_dtype not in (None, *GIVEN_IDS_DTYPES):
            problems.append(
                f"given_ids_dtype={given_ids_dtype} is not None or one of {GIVEN_IDS_DTYPES}"
            )
        if given_weights_dtype not in (None, *GIVEN_WEIGHTS_DTYPES):
            problems.append(
                f"given_weights_dtype={given_weights_dtype} is not None or one of "
                f"{GIVEN_WEIGHTS_DTYPES}"
            )
        if given_weights_dtype is not None and given_ids_dtype is None:
            problems.append("given weights come with given ids: pass given_ids_dtype too")
        if given_ids_dtype is not None and given_weights_dtype is None and scoring == "sparsemixer":
            problems.append(
                "given ids weighted from the logits need per-expert scores: scoring="
                "'sparsemixer' has none (give the weights too)"
            )
        if rows_dtype not in ROW_DTYPES:
            problems.append(f"rows dtype {rows_dtype} is not one of {ROW_DTYPES}")
        if rows_dtype == torch.float8_e4m3fn and not copy_by_token:
            problems.append("e4m3 rows are quantized by token (copy_by_token=True)")
        if gather_rows and rows_dtype != torch.bfloat16:
            problems.append("gathered rows are the bf16 tokens (rows_dtype=torch.bfloat16)")
        if weights_on_input and (gather_rows or rows_dtype != torch.bfloat16):
            problems.append(
                f"weights_on_input=True writes scaled bf16 rows, got gather_rows={gather_rows} "
                f"and rows_dtype={rows_dtype} (accepted: gather_rows=False, "
                "rows_dtype=torch.bfloat16)"
            )
        if problems:
            raise ValueError("the routing kernel cannot serve this layer: " + "; ".join(problems))
        largest_unroll = copy_unroll(hidden_size * 2)
        row_vectors = hidden_size // 8
        if unroll is None:
            unroll = largest_unroll
            if rows_dtype == torch.float8_e4m3fn:
                # measured (docs/benchmarks.md, "Routing kernel knobs"): a quantizing copy is
                # fastest with fewer loads in flight and more slices to share at decode
                while unroll > 1 and row_vectors < QUANTIZED_ROW_SLICES * 32 * unroll:
                    unroll //= 2
        elif unroll not in (1, 2, 4, 8) or (hidden_size // 8) % (32 * unroll):
            raise ValueError(
                f"unroll={unroll} must be 1, 2, 4 or 8 with 32 x unroll 16-byte vectors dividing "
                f"the row of hidden_size={hidden_size} (the largest here: {largest_unroll})"
            )
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.shared_experts = shared_experts
        # each token's pairs (its top_k, then the shared experts) and the batch's experts
        self.pairs = top_k + shared_experts
        self.batch_experts = num_experts + shared_experts
        self.logits_dtype, self.rows_dtype = logits_dtype, rows_dtype
        self.gather_rows = bool(gather_rows)
        self.weights_on_input = bool(weights_on_input)
        self.row_tokens = bool(row_tokens)
        self.scale_groups = None
        if rows_dtype == torch.float8_e4m3fn:
            from megamoe_kernels.drop.fp8_scaling import ACTIVATION_GROUP

            self.scale_groups = -(-hidden_size // ACTIVATION_GROUP)
        self.has_correction_bias = has_correction_bias
        self.shared_expert_gate = bool(shared_expert_gate)
        self.given_ids_dtype, self.given_weights_dtype = given_ids_dtype, given_weights_dtype
        # the placement takes logits unless the weights are given, a bias only where it chooses
        self._takes_logits = given_weights_dtype is None
        self._takes_bias = has_correction_bias and given_ids_dtype is None
        self.device = None if device is None else torch.device(device)
        self._scratch_words = _drop_route().scratch_words(self.batch_experts)
        # reuse_outputs: the last outputs per (device, stream), with the (tokens, capacity) they
        # were made for
        self._kept_outputs: dict[tuple, tuple[tuple[int, int], tuple]] = {}
        warps = _drop_route().ROUTE_WARPS
        if split_tokens is None:
            # measured (docs/benchmarks.md, "Routing kernel knobs"): splitting pays where a row
            # holds more than one slice of 32 x unroll vectors (dsv3's 7168: 7, gpt-oss's 2880:
            # 11 and a part); a row of one slice (qwen3's 2048 at unroll 8) only pays the CTA
            # barrier
            splits = row_vectors > 32 * unroll
            split_tokens = warps if splits else 0
        elif not 0 <= split_tokens <= warps:
            raise ValueError(
                f"split_tokens={split_tokens} must lie in [0, {warps}] (a CTA's warps)"
            )
        if cta_tokens is None:
            cta_tokens = warps
            if rows_dtype == torch.float8_e4m3fn and split_tokens:
                cta_tokens = _quantizing_cta_tokens(row_vectors, int(unroll), warps)
        elif not 1 <= cta_tokens <= warps:
            raise ValueError(f"cta_tokens={cta_tokens} must lie in [1, {warps}] (a CTA's warps)")
        cta_tokens = int(cta_tokens)
        if one_cta_tokens is None:
            # one CTA while its warps pass over the rows at most twice (the grid's barriers
            # cost about one pass)
            one_cta_tokens = min(
                2 * cta_tokens, _one_cta_tokens(self.pairs, hidden_size, copies=not gather_rows)
            )
        one_cta_tokens = int(one_cta_tokens)
        self.unroll, self.split_tokens = int(unroll), int(split_tokens)
        self.cta_tokens = cta_tokens
        self.publishes_offsets = bool(publish_offsets)
        self._one_cta_token_limit = _drop_route().one_cta_token_limit(
            self.batch_experts, one_cta_tokens, cta_tokens
        )
        # the routing as the kernels take it (one compile-time constant)
        self.rule = rule = _drop_route().RouteRule(
            num_experts=num_experts,
            top_k=top_k,
            scoring=scoring,
            renormalize=bool(renormalize),
            num_groups=num_groups,
            top_groups=top_groups,
            group_by_max=group_score == "max",
            choice_on_logits=bool(choice_on_logits),
            dropped_score=float(dropped_group_score),
            scaling=float(routed_scaling_factor),
            sparsemixer_eps=float(sparsemixer_eps),
        )
        constants = (
            rule,
            int(unroll),
            bool(copy_by_token),
            _BARRIER_TIMEOUT_NS,
            one_cta_tokens,
            shared_experts,
            self.weights_on_input,
            int(split_tokens),
            cta_tokens,
            self.publishes_offsets,
        )
        device_index = _device_index(self.device, compile_only)
        # the grid's CTAs, all resident at once, are sized by the GPU's SMs
        constants = (*constants, _persistent_ctas(device_index, 1))
        self._constants = constants
        self._key = (
            "route",
            constants,
            hidden_size,
            logits_dtype,
            rows_dtype,
            self.gather_rows,
            self.row_tokens,
            has_correction_bias,
            self.shared_expert_gate,
            given_ids_dtype,
            given_weights_dtype,
            device_index,
        )
        # route_tokens takes the routing rule alone
        self._route_only_key = (
            "route_tokens",
            rule,
            logits_dtype,
            has_correction_bias,
            device_index,
        )
        # each kernel compiled on its first use (or by compile()): route_and_place without and
        # with a token count
        self._route_and_place: dict[bool, Callable] = {}
        self._route_only = None

    def compile(self, *, route_only: bool = False, counted: bool = False) -> Callable:
        """The compiled route_and_place (or route_tokens), compiling it if needed; `counted`:
        the variant that takes a token count (__call__'s token_count)."""
        if route_only:
            if self._route_only is None:
                self._route_only = _compile(self._route_only_key, self._compile_route_only)
            return self._route_only
        return _compiled_variant(
            self._route_and_place,
            self._key,
            counted,
            lambda: self._compile(self._constants, counted),
        )

    def _compile(self, constants: tuple, counted: bool) -> Callable:
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_stream

        from megamoe_kernels.shim.ffi_launch import row_major

        route = _drop_route().route_and_place
        tokens = cute.sym_int32(symbol="tokens")
        rows = cute.sym_int32(symbol="rows")
        experts, pairs, hidden = self.num_experts, self.pairs, self.hidden_size

        def given(dtype):
            return None if dtype is None else row_major(_cutlass_dtype(dtype), (tokens, self.top_k))

        return cute.compile(
            route,
            row_major(_cutlass_dtype(self.logits_dtype), (tokens, experts))
            if self._takes_logits
            else None,
            row_major(cutlass.Float32, (experts,)) if self._takes_bias else None,
            row_major(cutlass.Float32, (tokens,)) if self.shared_expert_gate else None,
            given(self.given_ids_dtype),
            given(self.given_weights_dtype),
            row_major(cutlass.BFloat16, (tokens, hidden)),
            row_major(cutlass.Int32, (tokens, pairs)),
            row_major(cutlass.Float32, (tokens, pairs)),
            row_major(cutlass.Int32, (tokens, pairs)),
            row_major(cutlass.Int32, (self.batch_experts + 1,)),
            None
            if self.gather_rows
            else row_major(_cutlass_dtype(self.rows_dtype), (rows, hidden)),
            None
            if self.scale_groups is None
            else row_major(cutlass.Float32, (self.scale_groups, rows)),
            row_major(cutlass.Int32, (rows,)) if self.gather_rows or self.row_tokens else None,
            row_major(cutlass.Float32, (rows,)) if self.row_tokens else None,
            row_major(cutlass.BFloat16, (tokens, hidden)) if self.row_tokens else None,
            row_major(cutlass.Int32, (self._scratch_words,)),
            row_major(cutlass.Int64, (4,)),
            row_major(cutlass.Int32, (1,)) if counted else None,
            *constants,
            make_fake_stream(use_tvm_ffi_env_stream=True),
            options="--enable-tvm-ffi",
        )

    def _compile_route_only(self) -> Callable:
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_stream

        from megamoe_kernels.shim.ffi_launch import row_major

        tokens = cute.sym_int32(symbol="tokens")
        experts, top_k = self.num_experts, self.top_k
        return cute.compile(
            _drop_route().route_tokens,
            row_major(_cutlass_dtype(self.logits_dtype), (tokens, experts)),
            row_major(cutlass.Float32, (experts,)) if self.has_correction_bias else None,
            row_major(cutlass.Int32, (tokens, top_k)),
            row_major(cutlass.Float32, (tokens, top_k)),
            self._constants[0],
            make_fake_stream(use_tvm_ffi_env_stream=True),
            options="--enable-tvm-ffi",
        )

    def route(
        self, router_logits_TE: torch.Tensor, *, correction_bias_E: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids_TK int32, topk_weights_TK float32) alone, one launch: the routing of
        __call__ without the placement and the copy (for the expert-parallel dispatchers)."""
        compiled = self.compile(route_only=True)
        tokens = router_logits_TE.shape[0]
        device = router_logits_TE.device
        ids_TK = torch.empty((tokens, self.top_k), dtype=torch.int32, device=device)
        weights_TK = torch.empty((tokens, self.top_k), dtype=torch.float32, device=device)
        try:
            compiled(router_logits_TE, correction_bias_E, ids_TK, weights_TK)
        except Exception as failure:
            self._explain(failure, router_logits_TE, None, correction_bias_E)
        return ids_TK, weights_TK

    def _scratch(
        self, device: torch.device, *, tokens: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scratch, status) for a launch of `tokens` on the current stream (None: the zeroed
        ones a grid of CTAs needs). A launch of one CTA touches neither: it takes tensors that
        are never zeroed, so a CUDA graph that captures it records no fill of its own copy
        (two kernels fewer on a decode step's critical path)."""
        if device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        if tokens is not None and tokens <= self._one_cta_token_limit:
            make = torch.empty
            what = ("route, untouched", self._scratch_words)
        else:
            make = torch.zeros
            what = ("route", self._scratch_words)
        return _stream_scratch(
            device,
            what,
            lambda: (
                make(self._scratch_words, dtype=torch.int32, device=device),
                make(4, dtype=torch.int64, device=device),
            ),
        )

    def status(self, device: torch.device) -> list[int]:
        """The status block of the current stream's launches: all 0 unless a grid-barrier wait
        timed out (then phase + 1, barrier, 0, observed). Reads the GPU: a host sync."""
        return self._scratch(torch.device(device))[1].tolist()

    def __call__(
        self,
        router_logits_TE: torch.Tensor | None,
        x_TH: torch.Tensor,
        *,
        capacity: int,
        correction_bias_E: torch.Tensor | None = None,
        shared_gate_T: torch.Tensor | None = None,
        topk_ids_TK: torch.Tensor | None = None,
        topk_weights_TK: torch.Tensor | None = None,
        token_count: torch.Tensor | None = None,
        reuse_outputs: bool = False,
        out_TH: torch.Tensor | None = None,
    ) -> RouteOutputs:
        """The routing's outputs (RouteOutputs). capacity >= T x pairs rows (checked here: the
        kernel writes rows up to T x pairs - 1; pairs = K + shared_experts, the columns of the
        [T, pairs] outputs). shared_gate_T: the shared experts' gate logits, float32 [T], given
        exactly when built with shared_expert_gate=True. topk_ids_TK [T, K] (and
        topk_weights_TK [T, K]): the given experts (and weights) of a launcher built with
        given_ids_dtype (and given_weights_dtype), refused by others; router_logits_TE is then
        None where the weights are given, and the correction bias plays no part. `token_count`:
        an int32 [1] tensor on x's device whose value, read by the kernel, says how many of the
        T tokens to take (the first min(count, T): a CUDA graph of T token rows replaying fewer
        tokens); the outputs' entries of the tokens past it and expert_offsets' pairs are left
        out (None: all T).
        `out_TH` (bf16 [T, H], given exactly to a launcher built with row_tokens=True): the
        output a down GEMM adds the rows into; the launch zeroes its (counted) tokens' rows.

        `reuse_outputs`: the outputs of the last call on this stream with the same tokens and
        capacity are written again instead of allocating new ones (five allocations fewer per
        call), for a caller that is done with them once its later launches on this stream have
        read them (the layer's forward). Calls on one stream run one after another, so that is
        safe there. Under CUDA-graph capture the outputs are new, in the graph's memory pool
        (a graph replays on other streams than its capture stream)."""
        tokens = x_TH.shape[0]
        for name, tensor, built_for in (
            ("router_logits_TE", router_logits_TE, self._takes_logits),
            ("topk_ids_TK", topk_ids_TK, self.given_ids_dtype is not None),
            ("topk_weights_TK", topk_weights_TK, self.given_weights_dtype is not None),
        ):
            if (tensor is not None) != built_for:
                raise ValueError(
                    f"{name} is {'required' if built_for else 'refused'} by this launcher (built "
                    f"with given_ids_dtype={self.given_ids_dtype}, given_weights_dtype="
                    f"{self.given_weights_dtype})"
                )
        if (out_TH is not None) != self.row_tokens:
            raise ValueError(
                "out_TH is required by a launcher built with row_tokens=True and refused by "
                f"others (this one: row_tokens={self.row_tokens})"
            )
        if (shared_gate_T is not None) != self.shared_expert_gate:
            raise ValueError(
                "shared_gate_T is required by a launcher built with shared_expert_gate=True and "
                f"refused by others (this one: shared_expert_gate={self.shared_expert_gate})"
            )
        if tokens * self.pairs > capacity:
            per_token = (
                f"(top_k {self.top_k} + {self.shared_experts} shared experts)"
                if self.shared_experts
                else f"top_k {self.top_k}"
            )
            raise ValueError(
                f"{tokens} tokens x {per_token} = {tokens * self.pairs} rows exceed the "
                f"capacity {capacity}; raise capacity or send fewer tokens per call"
            )
        device = x_TH.device
        if token_count is not None:
            _check_token_count(token_count, device)
        if reuse_outputs and keeps_buffers():
            key = (device, _current_stream_handle(device))
            kept = self._kept_outputs.get(key)
            if kept is None or kept[0] != (tokens, capacity):
                kept = (tokens, capacity), self._new_outputs(tokens, capacity, x_TH)
                self._kept_outputs[key] = kept
            outputs = kept[1]
        else:
            outputs = self._new_outputs(tokens, capacity, x_TH)
        scratch, status = self._scratch(device, tokens=tokens)
        compiled = self.compile(counted=token_count is not None)
        if self.given_ids_dtype is not None:
            correction_bias_E = None  # it only chooses experts: given ones need none
        try:
            compiled(
                router_logits_TE,
                correction_bias_E,
                shared_gate_T,
                topk_ids_TK,
                topk_weights_TK,
                x_TH,
                *outputs,  # the kernel's output arguments, in their order (RouteOutputs)
                out_TH,
                scratch,
                status,
                token_count,
            )
        except Exception as failure:
            self._explain(
                failure,
                router_logits_TE,
                x_TH,
                correction_bias_E,
                shared_gate_T,
                topk_ids_TK,
                topk_weights_TK,
                out_TH,
            )
        return outputs

    def _new_outputs(self, tokens: int, capacity: int, x_TH: torch.Tensor) -> RouteOutputs:
        """__call__'s outputs, new (None where not built)."""
        device = x_TH.device
        return RouteOutputs(
            torch.empty((tokens, self.pairs), dtype=torch.int32, device=device),
            torch.empty((tokens, self.pairs), dtype=torch.float32, device=device),
            torch.empty((tokens, self.pairs), dtype=torch.int32, device=device),
            # with publishes_offsets, the word the kernel publishes them in follows them
            published_offsets_buffer(self.batch_experts + 1, device=device)
            if self.publishes_offsets
            else torch.empty(self.batch_experts + 1, dtype=torch.int32, device=device),
            None
            if self.gather_rows
            else torch.empty((capacity, self.hidden_size), dtype=self.rows_dtype, device=device),
            None
            if self.scale_groups is None
            else torch.empty((self.scale_groups, capacity), dtype=torch.float32, device=device),
            torch.empty(capacity, dtype=torch.int32, device=device)
            if self.gather_rows or self.row_tokens
            else None,
            torch.empty(capacity, dtype=torch.float32, device=device) if self.row_tokens else None,
        )

    def _explain(
        self,
        failure,
        router_logits_TE,
        x_TH,
        correction_bias_E,
        shared_gate_T=None,
        topk_ids_TK=None,
        topk_weights_TK=None,
        out_TH=None,
    ) -> None:
        """Re-raises a refused launch as an error that names the argument at fault."""
        tokens = None if x_TH is None else x_TH.shape[0]
        checks = []
        if router_logits_TE is not None:
            checks.append(
                ("router_logits", router_logits_TE, self.logits_dtype, (tokens, self.num_experts))
            )
        if x_TH is not None:
            checks.append(("x", x_TH, torch.bfloat16, (tokens, self.hidden_size)))
            if self.shared_expert_gate:
                checks.append(("shared_gate", shared_gate_T, torch.float32, (tokens,)))
            if self.row_tokens:
                checks.append(("out_TH", out_TH, torch.bfloat16, (tokens, self.hidden_size)))
            given = (
                ("topk_ids", topk_ids_TK, self.given_ids_dtype),
                ("topk_weights", topk_weights_TK, self.given_weights_dtype),
            )
            for name, tensor, dtype in given:
                if dtype is not None:
                    checks.append((name, tensor, dtype, (tokens, self.top_k)))
        if self._takes_bias:
            checks.append(
                ("correction_bias", correction_bias_E, torch.float32, (self.num_experts,))
            )
        elif correction_bias_E is not None:
            raise ValueError(
                "correction_bias given to a launcher compiled without one"
            ) from failure
        for name, tensor, dtype, shape in checks:
            _check_tensor(name, tensor, dtype, shape, failure)
        raise failure


class CombineLauncher:
    """The fixed-order weighted top-k sum for (top_k, hidden, weighted or not, addend or
    not), compiled once; a call allocates y and launches one kernel."""

    def __init__(
        self,
        *,
        top_k: int,
        hidden_size: int,
        weighted: bool = True,
        has_addend: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        compile_only: bool = False,
    ):
        if hidden_size % 8:
            raise ValueError(f"hidden_size={hidden_size} must be a multiple of 8")
        if dtype not in ROW_DTYPES:
            raise ValueError(f"the combine kernel runs {ROW_DTYPES}, got {dtype}")
        if not 1 <= top_k <= 32:
            raise ValueError(f"top_k={top_k} must lie in [1, 32]")
        self.top_k, self.hidden_size, self.dtype = top_k, hidden_size, dtype
        self.weighted, self.has_addend = weighted, has_addend
        device = None if device is None else torch.device(device)
        device_index = _device_index(device, compile_only)
        key = ("combine", top_k, hidden_size, weighted, has_addend, dtype, device_index)
        # the grid's one wave is sized by the GPU's SMs
        self._sms = _persistent_ctas(device_index, 1)
        self._key = key
        # each variant (without and with a token count) compiled on its first use: without one
        # now
        self._compiled: dict[bool, Callable] = {}
        self.compile()

    def compile(self, *, counted: bool = False) -> Callable:
        """The compiled combine (`counted`: the variant that takes a token count), compiling it
        if needed."""
        return _compiled_variant(self._compiled, self._key, counted, lambda: self._compile(counted))

    def _compile(self, counted: bool) -> Callable:
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_stream

        from megamoe_kernels.shim.ffi_launch import row_major

        _drop_route()  # sets the architecture without a GPU
        from megamoe_kernels.drop.local_combine import combine_pairs

        tokens = cute.sym_int32(symbol="tokens")
        rows = cute.sym_int32(symbol="rows")
        element = _cutlass_dtype(self.dtype)
        hidden, top_k = self.hidden_size, self.top_k
        return cute.compile(
            combine_pairs,
            row_major(element, (rows, hidden)),
            row_major(cutlass.Int32, (tokens, top_k)),
            row_major(cutlass.Float32, (tokens, top_k)) if self.weighted else None,
            row_major(element, (tokens, hidden)) if self.has_addend else None,
            row_major(element, (tokens, hidden)),
            row_major(cutlass.Int32, (1,)) if counted else None,
            top_k,
            self._sms,
            make_fake_stream(use_tvm_ffi_env_stream=True),
            options="--enable-tvm-ffi",
        )

    def __call__(
        self,
        expert_out_MH: torch.Tensor,
        row_of_pair_TK: torch.Tensor,
        topk_weights_TK: torch.Tensor | None,
        *,
        addend_TH: torch.Tensor | None = None,
        out_TH: torch.Tensor | None = None,
        token_count: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y [T, hidden] of the T = row_of_pair_TK.shape[0] tokens, written into `out_TH` (a
        row-major [T, hidden] tensor of the rows' dtype) where given, else a new tensor.
        `token_count` (int32 [1] on the device, as RouteLauncher takes it): only the first
        min(count, T) rows of y are written."""
        shape = (row_of_pair_TK.shape[0], self.hidden_size)
        if out_TH is None:
            y_TH = expert_out_MH.new_empty(shape)
        elif (
            tuple(out_TH.shape) != shape
            or out_TH.dtype != self.dtype
            or not out_TH.is_contiguous()
            or out_TH.device != expert_out_MH.device
        ):
            raise ValueError(
                f"out: a contiguous {list(shape)} {self.dtype} tensor on {expert_out_MH.device}"
                f" expected, got {list(out_TH.shape)} {out_TH.dtype} on {out_TH.device}"
                f" (contiguous: {out_TH.is_contiguous()})"
            )
        else:
            y_TH = out_TH
        if token_count is not None:
            _check_token_count(token_count, expert_out_MH.device)
        compiled = self.compile(counted=token_count is not None)
        try:
            compiled(expert_out_MH, row_of_pair_TK, topk_weights_TK, addend_TH, y_TH, token_count)
        except Exception as failure:
            tokens = row_of_pair_TK.shape[0]
            _check_tensor(
                "expert_out", expert_out_MH, self.dtype, (None, self.hidden_size), failure
            )
            _check_tensor("row_of_pair", row_of_pair_TK, torch.int32, (None, self.top_k), failure)
            if self.weighted:
                _check_tensor(
                    "topk_weights", topk_weights_TK, torch.float32, (tokens, self.top_k), failure
                )
            if self.has_addend:
                _check_tensor("addend", addend_TH, self.dtype, (tokens, self.hidden_size), failure)
            raise failure
        return y_TH


def _check_token_count(token_count: torch.Tensor, device: torch.device) -> None:
    """Refuses a token count that is not one int32 word on the launch's device (a shape check:
    its value stays on the device)."""
    if not (
        isinstance(token_count, torch.Tensor)
        and token_count.dtype == torch.int32
        and token_count.numel() == 1
        and token_count.device == device
    ):
        got = (
            f"{token_count.dtype} {list(token_count.shape)} on {token_count.device}"
            if isinstance(token_count, torch.Tensor)
            else type(token_count).__name__
        )
        raise ValueError(f"token_count: one int32 word on {device} expected, got {got}")


def _check_tensor(name, tensor, dtype, shape, failure) -> None:
    """Raises a ValueError/TypeError naming `name` if it does not match (dtype, shape with None
    for any size, contiguous, 16-byte aligned), chained to the launch's `failure`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}") from failure
    if tensor.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {tensor.dtype}") from failure
    if tensor.dim() != len(shape) or any(
        want is not None and have != want for have, want in zip(tensor.shape, shape, strict=True)
    ):
        expected = tuple("any" if want is None else want for want in shape)
        raise ValueError(
            f"{name} must have shape {expected}, got {tuple(tensor.shape)}"
        ) from failure
    if not tensor.is_contiguous() or tensor.data_ptr() % 16:
        raise ValueError(f"{name} must be contiguous and 16-byte aligned") from failure


def _compiled_variant(
    variants: dict[bool, Callable], key: tuple, counted: bool, compile_fn: Callable[[], Callable]
) -> Callable:
    """A launcher's compiled kernel without or with a token count (`counted`), kept in its own
    `variants` after the first lookup in the shared cache under (*key, counted)."""
    compiled = variants.get(counted)
    if compiled is None:
        compiled = variants[counted] = _compile((*key, counted), compile_fn)
    return compiled


def _compile(key: tuple, compile_fn: Callable[[], Callable]) -> Callable:
    compiled = _COMPILED.get(key)
    if compiled is not None:
        return compiled
    with _COMPILE_LOCK:
        compiled = _COMPILED.get(key)
        if compiled is None:
            compiled = _COMPILED[key] = compile_fn()
    return compiled


def route_launcher(**constants) -> RouteLauncher:
    """A RouteLauncher, kept per set of constants (its compiled kernel is shared anyway)."""
    key = tuple(sorted(constants.items(), key=lambda item: item[0]))
    launcher = _ROUTE_LAUNCHERS.get(key)
    if launcher is None:
        launcher = _ROUTE_LAUNCHERS[key] = RouteLauncher(**constants)
    return launcher


def combine_launcher(**constants) -> CombineLauncher:
    """A CombineLauncher, kept per set of constants."""
    key = tuple(sorted(constants.items(), key=lambda item: item[0]))
    launcher = _COMBINE_LAUNCHERS.get(key)
    if launcher is None:
        launcher = _COMBINE_LAUNCHERS[key] = CombineLauncher(**constants)
    return launcher


_ROUTE_LAUNCHERS: dict[tuple, RouteLauncher] = {}
_COMBINE_LAUNCHERS: dict[tuple, CombineLauncher] = {}
