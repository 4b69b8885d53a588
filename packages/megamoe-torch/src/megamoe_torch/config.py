"""MegaMoEConfig: everything that defines a MegaMoE layer, as one frozen dataclass."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from megamoe_kernels import SwiGLU
from megamoe_runtime.dispatch.checks import check_wire_dtypes
from megamoe_runtime.distributed import COMBINE_ORDERS
from megamoe_runtime.experts import BACKEND_NAMES
from megamoe_runtime.geometries import Geometry
from megamoe_runtime.routing import GROUP_SCORES, GroupScore, RouterConfig, Scoring
from megamoe_runtime.weights import ACTIVATIONS, SOFTCAPPED_SWIGLU, UNGATED_RELU2, WEIGHT_BLOCK

DISPATCHER_NAMES = ("auto", "torch", "nvshmem")
KNOB_MODES = ("lookup", "auto")
LAYER_PATHS = ("auto", "fused", "torch")
SHARED_EXPERTS_PATHS = ("auto", "batch", "side_stream", "caller_stream")
SharedExpertsPath = Literal["auto", "batch", "side_stream", "caller_stream"]
SHARED_SWIGLUS = ("silu", "routed")
WEIGHT_DTYPES = (None, "fp8")
# the integer fields: (name, least value, whether None is accepted)
INTEGER_FIELDS = (
    ("hidden_size", 1, False),
    ("intermediate_size", 1, False),
    ("num_experts", 1, False),
    ("top_k", 1, False),
    ("num_groups", 1, False),
    ("top_groups", 1, False),
    ("routing_table_vocab_size", 0, False),
    ("latent_size", 1, True),
    ("num_identity_experts", 0, False),
    ("num_shared_experts", 0, False),
    ("shared_intermediate_size", 1, True),
    ("capacity", 0, True),
    ("max_tokens_per_rank", 1, False),
    ("eager_graph_tokens", 0, False),
    ("bucket_graph_tokens", 0, False),
)


@dataclass(frozen=True)
class MegaMoEConfig:
    """Everything that defines a MegaMoE layer: its routing, its experts and shared experts,
    their precision, and how it runs. Frozen; a field out of range raises ValueError (TypeError
    for a wrong type) naming it. `from_geometry` builds one from a benchmark geometry
    (megamoe_runtime.geometries); the Hugging Face readers build one from a block."""

    # the hidden states' size H
    hidden_size: int
    # each routed expert's intermediate size I (its gate and up projections are I x H)
    intermediate_size: int
    # routed experts E
    num_experts: int
    # experts each token is routed to K
    top_k: int
    # the router's scores of the logits: "softmax" over the experts, "sigmoid" or
    # "sqrtsoftplus" (sqrt(softplus), DeepSeek-V4) of each logit, or "sparsemixer" (PhiMoE's;
    # top_k = 2)
    scoring: Scoring = "softmax"
    # the K weights divided by their sum (+ 1e-20 with sigmoid and sqrtsoftplus scores)
    renormalize: bool = True
    # grouped top-k: the experts split into this many groups of consecutive experts
    num_groups: int = 1
    # grouped top-k: the groups kept (by group_score), whose experts the top-k chooses from
    top_groups: int = 1
    # the weights' scale, after the renormalisation (DeepSeek-V3: 2.5)
    routed_scaling_factor: float = 1.0
    # a per-expert correction bias (the buffer `e_score_correction_bias` [E], fp32) added to
    # the choice scores for choosing, not to the weights (DeepSeek-V3, ERNIE 4.5)
    use_correction_bias: bool = False
    # grouped top-k: choice score of experts in groups not kept, -inf or 0.0 (RouterConfig)
    dropped_group_score: float = float("-inf")
    # grouped top-k: a group's score, the sum of its two best experts' ("top2_sum", DeepSeek-V3)
    # or its best expert's ("max", DeepSeek-V2)
    group_score: GroupScore = "top2_sum"
    # the experts are chosen on logits + correction bias, not scores + correction bias (Kolibri)
    choice_on_logits: bool = False
    # scoring="sparsemixer" (PhiMoE): the relative gap below a round's largest logit, in units
    # of 2 x this, past which a logit is left out of the round's softmax (RouterConfig)
    sparsemixer_eps: float = 0.01
    # routing by token id (DeepSeek-V4's hash layers): the vocabulary size V of the layer's
    # `routing_table` [V, top_k] (int64), whose row input_ids[t] names token t's experts in place
    # of the top-k of its scores; their weights are still their scores, renormalised and scaled
    # (no correction bias, no groups). The forward then takes `input_ids`. On the fused path
    # the routing kernel places the table's experts (eager forwards replay the layer's graphs,
    # the ids copied in beside the tokens). 0: the top-k of the scores
    routing_table_vocab_size: int = 0
    # the router's matmul: "float32" (accurate) or "input" (in the hidden states' dtype, as
    # Mixtral and Qwen blocks in transformers do)
    router_dtype: Literal["float32", "input"] = "float32"
    # the router adds a bias to its logits, x W_gate^T + b (gpt-oss): `gate.bias` [E]
    router_bias: bool = False
    # The expert math below is computed by every backend, with bf16 weights (FP8 experts
    # compute the SwiGLU's variants, not the biases nor relu^2); `expert_math_features` names
    # what a config uses of it.

    # each expert projection adds a per-expert bias (gpt-oss): `w13_bias` [E, 2I], `w2_bias` [E, H]
    expert_bias: bool = False
    # the experts' SwiGLU, gate * sigmoid(swiglu_alpha * gate) * (up + swiglu_up_offset), with
    # gate clamped to at most swiglu_limit and up to [-swiglu_limit, swiglu_limit] when it is set;
    # the defaults are silu(gate) * up. gpt-oss: 7.0, 1.702, 1.0
    swiglu_limit: float | None = None
    # the SwiGLU's alpha (swiglu_limit)
    swiglu_alpha: float = 1.0
    # the SwiGLU's offset added to up (swiglu_limit)
    swiglu_up_offset: float = 0.0
    # a softcap c of the SwiGLU's linear gate factor (Inkling2): c * tanh(gate / c) in place of
    # gate (the sigmoid sees gate as it is); None: no cap
    swiglu_gate_softcap: float | None = None
    # a softcap c of the SwiGLU's up (Inkling2): c * tanh(up / c) in place of up; None: no cap
    swiglu_up_softcap: float | None = None
    # a cubic term b of the sigmoid's gate, sigmoid(swiglu_alpha * (gate + b gate^3)): with
    # swiglu_alpha = 2 sqrt(2 / pi) and b = 0.044715 the gate factor is the tanh GELU, GeGLU
    # (Gemma 4's experts; megamoe_kernels.GEGLU holds the two constants); 0.0: none
    swiglu_gate_cubic: float = 0.0
    # the experts' activation: "swiglu", gated experts down(swiglu(gate x, up x)), `w13`
    # [E, 2I, H]; "relu2", ungated experts down(relu(up x)^2) (Nemotron-H), `w13` the up
    # projection alone [E, I, H] (and `w13_bias` [E, I]), the shared experts likewise (up_proj
    # and down_proj). relu2 runs on the grouped_mm and reference backends (the cutedsl kernels
    # compute gated experts), in bf16 or fp32 weights
    activation: Literal["swiglu", "relu2"] = "swiglu"
    # each chosen expert computes on its routing weight times the token, f_e(w_e x), and the
    # top-k outputs are summed unweighted (Llama 4); otherwise the sum of w_e f_e(x). w_e x is
    # rounded to x's dtype (x * w.to(x.dtype), as transformers computes it), then the experts
    # run on it: every backend with bf16 weights, the fused path too (its routing kernel scales
    # each row as it copies it); not under expert parallelism
    routing_weights_on_input: bool = False
    # the routed experts compute in a latent space of this size (Nemotron-H's latent MoE): the
    # layer projects the tokens into it before the dispatch (`latent_in.weight` [L, H]) and the
    # combined output back (`latent_out.weight` [H, L]), bias-free; the router and the shared
    # experts see the tokens as they are, and `w13` is [E, 2I, L], `w2` [E, L, I]. The torch
    # layer path computes it (fused_path_status says why not the fused one)
    latent_size: int | None = None
    # experts that compute nothing and return their token (LongCat-Flash's zero-computation
    # experts): the router scores num_experts + num_identity_experts (`gate.weight` and the
    # correction bias have that many rows), and a token's pairs with one of the last
    # num_identity_experts add routing weight x token to its output and take no row of the
    # expert MLP. The torch layer path on one device computes them (fused_path_status says why
    # not the fused one; expert parallelism refuses them)
    num_identity_experts: int = 0
    # the layer's output normalised (A.X-K1's post-MLP norm): y * rsqrt(mean(y^2) + eps) in
    # fp32, rounded to y's dtype, times `output_norm.weight` [H]; None: no norm. Every layer
    # path computes it, after the shared experts are added
    output_norm_eps: float | None = None
    # shared experts every token visits, summed as one MLP of shared_intermediate_size
    num_shared_experts: int = 0
    # defaults to intermediate_size * num_shared_experts
    shared_intermediate_size: int | None = None
    # Qwen2-MoE: the shared experts' output is scaled by sigmoid(x . w_gate)
    shared_expert_gate: bool = False
    # the shared experts' activation: "silu", silu(gate) * up; "routed", the routed experts'
    # SwiGLU (swiglu_limit, swiglu_alpha, swiglu_up_offset), as MiniMax-M3's shared MLP clamps
    # it with the routed experts' constants
    shared_swiglu: Literal["silu", "routed"] = "silu"
    # where the fused path (one GPU) computes the shared experts:
    # "batch": in the routed experts' batch, as S = shared_size / intermediate_size more experts
    #   every token visits with weight 1 (the shared MLP cut into S experts of the routed size),
    #   or with shared_expert_gate sigmoid(x . w_gate), computed by the same two grouped GEMMs
    #   and summed by the same combine; routed and shared weights of one dtype (bf16, or FP8
    #   with intermediate_size a multiple of 128), no expert bias, the plain SwiGLU,
    #   shared_size a multiple of intermediate_size. The layer then keeps the routed and shared
    #   experts' weights together, its routed weights views of them where the backend keeps
    #   their layout (no copy; the cutedsl kernels read w13 and w2 as they are);
    # "side_stream": their own MLP on a side stream of the caller's stream, beside the routing
    #   and the routed experts, joined before the combine adds their output;
    # "caller_stream": their own MLP on the caller's stream, after the routed experts (the
    #   side stream's bits);
    # "auto": the measured choice (shared_experts_in_batch_by_default), else "side_stream".
    # The torch layer path (and expert parallelism) runs them as their own MLP.
    shared_experts_path: SharedExpertsPath = "auto"
    # the routed experts' compute: "cutedsl" (megamoe's kernels, sm_90a), "grouped_mm"
    # (torch._grouped_mm), "reference" (pure torch, fp32 accumulation), or "auto": the first of
    # these that runs here (`MegaMoE.backend_reason` says why)
    backend: str = "auto"
    # the routed experts' weights: None, in the layer's dtype; "fp8", e4m3 with one float32
    # scale per 128 x 128 block (the format of DeepSeek-V3's and Qwen3's FP8 checkpoints): the
    # layer holds `w13`/`w2` in e4m3 and `w13_scale_inv`/`w2_scale_inv`, quantizes weights it is
    # given in another dtype when they load, and on an sm_90 GPU runs the FP8 kernels (the
    # activations quantized per row and 128 channels); the reference backend computes with the
    # dequantized weights (the FP8 oracle)
    weight_dtype: Literal["fp8"] | None = None
    # the cutedsl backend's routed-expert weights in the weight-packet layout (each 128-row tile
    # of a K tile contiguous, in the order the GEMMs read them; FP8 tiles followed by their
    # block scales in the same allocation): the same output bits, laid out once when the
    # weights are prepared. Opt-in (docs/benchmarks.md, "Weight packets"). Needs H and 2I
    # multiples of 256 and no expert biases (refused at load with the reason); the other
    # backends keep their own layout
    tile_pack: bool = False
    # the shared experts' weights: None, in the layer's dtype; "fp8", e4m3 with one float32
    # scale per 128 x 128 block (`shared_experts.{gate,up,down}_proj.weight` and
    # `.weight_scale_inv`, as DeepSeek-V3's FP8 checkpoints hold them), quantized as they load
    # when given in another dtype, computed with the weights dequantized into the activations'
    # dtype (kept until they change)
    shared_weight_dtype: Literal["fp8"] | None = None
    # rows of the expert batch; None: tokens x top_k of each call. Fix it for CUDA graphs.
    capacity: int | None = None
    # data-dependent input checks (finite logits, ...): each costs a host sync
    check_inputs: bool = False
    # where a forward routes: "fused" (device kernels, sm_90 GPUs: on one GPU one launch routes
    # and dispatches and one combines; under expert parallelism one launch routes and the
    # dispatcher places), "torch" (torch ops, any device, and the path autograd takes), "auto"
    # (fused where it can run)
    layer_path: Literal["auto", "fused", "torch"] = "auto"
    # expert parallelism, MegaMoE(config, process_group=...): "auto" picks "nvshmem" (symmetric
    # memory kernels) where CUDA GPUs and nvshmem4py are present, else "torch" (all_to_all_single)
    dispatcher: str = "auto"
    # static bound on one rank's tokens per forward: sizes the nvshmem dispatcher's buffers
    max_tokens_per_rank: int = 2048
    # how the nvshmem dispatcher sums a token's top-k outputs: "exact" (every (token, expert)
    # output comes home; k order in fp32, bitwise equal to the single-GPU layer) or
    # "owner_partials" (each owner rank sums its share and sends one bf16 row per token: up to
    # top_k x fewer NVLink bytes and faster, but one more bf16 rounding, so not bitwise equal to
    # one GPU). The torch dispatcher always combines exactly.
    combine_order: Literal["exact", "owner_partials"] = "exact"
    # what crosses NVLink in the nvshmem dispatcher: "bf16" (default, exact) or "fp8" (e4m3
    # rows with one float32 scale per row and 128 columns: half the bytes, e4m3's 3 mantissa
    # bits on the values). dispatch_dtype="fp8": the dispatch kernels quantize each token row
    # and the batch reaches FP8 experts (weight_dtype="fp8") as it is; bf16 experts dequantize
    # it first. combine_dtype="fp8": each expert output (or owner partial sum) crosses back
    # as e4m3 and is summed in fp32. Opt-in: both change the numbers (docs/expert-parallel.md).
    # Both need a hidden size that is a multiple of 16; the torch dispatcher always moves bf16.
    dispatch_dtype: Literal["bf16", "fp8"] = "bf16"
    # what crosses NVLink back from the experts in the nvshmem dispatcher (dispatch_dtype)
    combine_dtype: Literal["bf16", "fp8"] = "bf16"
    # where the cutedsl GEMMs' knobs come from. "lookup": the knob cache (`megamoe tune`), else
    # the entries megamoe ships, else the default profile; nothing is measured at run time.
    # "auto": the same, and a batch class none of them holds is tuned at the forward that first
    # meets it (expert parallel: at the first forward, every rank in lockstep): the candidates
    # that keep the numbers are compiled and timed, a few minutes per class, and the winner is
    # stored in the knob cache, where later processes look it up (docs/tuning.md). Backends
    # without knobs ignore it.
    knobs: Literal["lookup", "auto"] = "lookup"
    # eager forwards of 1 to this many tokens on the fused path (one GPU, no autograd, not
    # under an outer CUDA-graph capture or torch.compile, check_inputs off) replay a CUDA graph
    # the layer captures at the second forward of each token count (and weights, stream), so
    # a decode step costs the host a replay (its first node copies the tokens in) in place of
    # the launches, and returns the graph's own output, replayed into again only once the
    # caller has dropped it (forward_graphs.py); the graphs share one memory pool per stream.
    # 0: always launch.
    eager_graph_tokens: int = 128
    # eager forwards of more than eager_graph_tokens and up to this many tokens, under the same
    # conditions, replay a CUDA graph of their bucket: the next power of two of their tokens
    # (at most this), captured at the bucket's second forward and replayed for any count of
    # it, the routing and combine kernels reading the count from the device, so that a
    # prefill forward of any length costs the host a replay too (forward_graphs.py says what
    # the bucket's rows past the count cost, and how its bits can differ from a launched
    # forward's). Each bucket's graph holds its static input and output (2 x T x H values)
    # outside the graphs' shared pool. 0 (or no more than eager_graph_tokens): none.
    bucket_graph_tokens: int = 0
    # the fused path with bf16 experts on the cutedsl backend (hidden size a multiple of 64):
    # True, the dispatch writes only the token of each batch row and the gate-up GEMM reads
    # the rows from the tokens (no expert-major copy of the tokens: top_k x T x H x 2 bytes
    # written and read less); False, the dispatch copies each token into its top-k rows; None,
    # the measured choice: gathered where the GEMMs run decode tiles, from 2 tokens on
    # (megamoe_kernels.shim.knobs.gathers_rows_by_default; docs/benchmarks.md, "Gathered
    # rows"). The same bits either way. routing_weights_on_input=True copies (each row is
    # scaled as it is copied): None or False.
    gather_rows: bool | None = None
    # the fused path on one GPU with the cutedsl backend: the down GEMM adds each expert output
    # row, times its routing weight, into its token's output row by atomic bf16 reductions at
    # the L2, in place of the combine kernel (the expert-major output rows are never written
    # and read back). Not deterministic: a token's adds land in the order the GEMM's tiles reach
    # them, and each add rounds to bf16 (about twice the ordered combine's error against the
    # fp32 oracle). Opt-in: the whole layer measured 1-8% faster at qwen3-30b-a3b's top-8 (but
    # at 16 tokens, and FP8 at 8192: within 0.3%), 1-2% at one token of mixtral-8x7b and
    # dsv3-ep8-local, and up to 1.5% slower at their 2048 (docs/benchmarks.md, "The combine by
    # atomic adds").
    # Elsewhere (the torch path, expert parallelism, the other backends) the combine is the
    # ordered one.
    atomic_combine: bool = False

    def __post_init__(self) -> None:
        for name, least, optional in INTEGER_FIELDS:
            value = getattr(self, name)
            if value is None and optional:
                continue
            accepted = f"an int >= {least}{' or None' if optional else ''}"
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be {accepted}, got {value!r}")
            if value < least:
                raise ValueError(f"{name} must be {accepted}, got {value!r}")
        if self.routing_table_vocab_size:
            choosing = [
                name
                for name, used in (
                    (f"scoring={self.scoring!r}", self.scoring == "sparsemixer"),
                    ("use_correction_bias=True", self.use_correction_bias),
                    (f"num_groups={self.num_groups}", self.num_groups > 1),
                    ("choice_on_logits=True", self.choice_on_logits),
                    (
                        f"num_identity_experts={self.num_identity_experts}",
                        self.num_identity_experts,
                    ),
                )
                if used
            ]
            if choosing:
                raise ValueError(
                    "routing_table_vocab_size > 0 takes each token's experts from the routing "
                    f"table and weighs them by their scores; it does not combine with "
                    f"{', '.join(choosing)}"
                )
        if self.num_identity_experts and self.latent_size is not None:
            raise ValueError(
                "num_identity_experts does not combine with latent_size (an identity expert "
                "returns the token, not a latent projection of it)"
            )
        if self.num_identity_experts and self.routing_weights_on_input:
            raise ValueError(
                "num_identity_experts does not combine with routing_weights_on_input=True (an "
                "identity expert's output is its routing weight times the token, not its input)"
            )
        if self.shared_expert_gate and self.num_shared_experts == 0:
            raise ValueError("shared_expert_gate needs num_shared_experts >= 1")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.activation == "relu2" and (
            not self.swiglu.is_plain or self.shared_swiglu != "silu"
        ):
            raise ValueError(
                "activation='relu2' (ungated experts) takes no SwiGLU: leave the swiglu_* "
                "fields and shared_swiglu at their defaults"
            )
        if self.shared_swiglu not in SHARED_SWIGLUS:
            raise ValueError(
                f"shared_swiglu must be one of {SHARED_SWIGLUS}, got {self.shared_swiglu!r}"
            )
        if self.shared_swiglu == "routed" and self.num_shared_experts == 0:
            raise ValueError("shared_swiglu='routed' needs num_shared_experts >= 1")
        for name in ("tile_pack", "atomic_combine"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.router_dtype not in ("float32", "input"):
            raise ValueError(
                f"router_dtype must be 'float32' or 'input', got {self.router_dtype!r}"
            )
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        for name in ("swiglu_limit", "swiglu_gate_softcap", "swiglu_up_softcap", "output_norm_eps"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0 or None, got {value}")
        for name in ("swiglu_alpha", "swiglu_up_offset", "swiglu_gate_cubic"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"weight_dtype must be one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}"
            )
        if self.shared_weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"shared_weight_dtype must be one of {WEIGHT_DTYPES}, got "
                f"{self.shared_weight_dtype!r}"
            )
        if self.shared_weight_dtype == "fp8" and self.num_shared_experts == 0:
            raise ValueError("shared_weight_dtype='fp8' needs num_shared_experts >= 1")
        fp8_refuses = [
            name
            for name, used in (
                ("expert_bias=True", self.expert_bias),
                (UNGATED_RELU2, self.activation == "relu2"),
                ("routing_weights_on_input=True", self.routing_weights_on_input),
            )
            if used
        ]
        if self.weight_dtype == "fp8" and fp8_refuses:
            raise ValueError(
                f"weight_dtype='fp8' does not combine with {', '.join(fp8_refuses)} (the FP8 "
                "experts and the FP8 dispatch do not compute it): use weight_dtype=None"
            )
        if self.gather_rows and self.routing_weights_on_input:
            raise ValueError(
                "gather_rows=True reads the batch rows from the tokens as they are, but "
                "routing_weights_on_input=True makes each row its token times its routing weight "
                "(the dispatch writes them scaled): use gather_rows=None or False"
            )
        if self.backend not in ("auto", *BACKEND_NAMES):
            raise ValueError(
                f"backend must be one of {('auto', *BACKEND_NAMES)}, got {self.backend!r}"
            )
        if self.shared_experts_path not in SHARED_EXPERTS_PATHS:
            raise ValueError(
                f"shared_experts_path must be one of {SHARED_EXPERTS_PATHS}, got "
                f"{self.shared_experts_path!r}"
            )
        if self.shared_experts_path == "batch" and self.num_shared_experts:
            problems = self.shared_experts_in_batch_problems
            if problems:
                raise ValueError(
                    f"shared_experts_path='batch' cannot put these shared experts into the "
                    f"routed batch: {'; '.join(problems)}; use 'side_stream' or 'auto'"
                )
        if self.layer_path not in LAYER_PATHS:
            raise ValueError(f"layer_path must be one of {LAYER_PATHS}, got {self.layer_path!r}")
        if self.dispatcher not in DISPATCHER_NAMES:
            raise ValueError(
                f"dispatcher must be one of {DISPATCHER_NAMES}, got {self.dispatcher!r}"
            )
        if self.knobs not in KNOB_MODES:
            raise ValueError(f"knobs must be one of {KNOB_MODES}, got {self.knobs!r}")
        if self.combine_order not in COMBINE_ORDERS:
            raise ValueError(
                f"combine_order must be one of {COMBINE_ORDERS}, got {self.combine_order!r}"
            )
        check_wire_dtypes(
            dispatch_dtype=self.dispatch_dtype,
            combine_dtype=self.combine_dtype,
            hidden_size=self.hidden_size,
        )
        _ = self.router  # RouterConfig validates the routing fields

    @cached_property  # built once: forward reads it on every call
    def router(self) -> RouterConfig:
        return RouterConfig(
            num_experts=self.num_experts + self.num_identity_experts,
            top_k=self.top_k,
            scoring=self.scoring,
            renormalize=self.renormalize,
            num_groups=self.num_groups,
            top_groups=self.top_groups,
            routed_scaling_factor=self.routed_scaling_factor,
            use_correction_bias=self.use_correction_bias,
            dropped_group_score=self.dropped_group_score,
            group_score=self.group_score,
            choice_on_logits=self.choice_on_logits,
            sparsemixer_eps=self.sparsemixer_eps,
        )

    @property
    def expert_math_features(self) -> tuple[str, ...]:
        """The expert math beyond bias-free silu(gate) * up experts this config uses, which
        every backend computes with bf16 weights (FP8 experts: the SwiGLU's variants, neither
        biases nor relu^2): () when none."""
        features = []
        if self.expert_bias:
            features.append("expert_bias=True")
        if self.swiglu.clamped:
            features.append(
                f"a clamped/scaled SwiGLU (swiglu_limit={self.swiglu_limit}, "
                f"swiglu_alpha={self.swiglu_alpha}, swiglu_up_offset={self.swiglu_up_offset}, "
                f"swiglu_gate_cubic={self.swiglu_gate_cubic})"
            )
        if self.swiglu.softcapped:
            features.append(SOFTCAPPED_SWIGLU)
        if self.activation == "relu2":
            features.append(UNGATED_RELU2)
        return tuple(features)

    @property
    def expert_hidden_size(self) -> int:
        """The width of the rows the routed experts compute on: latent_size, else hidden_size."""
        return self.hidden_size if self.latent_size is None else self.latent_size

    @property
    def gated(self) -> bool:
        """Whether the experts (and shared experts) are gated: w13 holds gate and up rows."""
        return self.activation == "swiglu"

    @property
    def swiglu(self) -> SwiGLU:
        """The experts' activation, as the kernels and the weight pack take it."""
        return SwiGLU(
            limit=self.swiglu_limit,
            alpha=self.swiglu_alpha,
            up_offset=self.swiglu_up_offset,
            gate_softcap=self.swiglu_gate_softcap,
            up_softcap=self.swiglu_up_softcap,
            gate_cubic=self.swiglu_gate_cubic,
        )

    @property
    def shared_experts_swiglu(self) -> SwiGLU:
        """The shared experts' activation (shared_swiglu)."""
        return self.swiglu if self.shared_swiglu == "routed" else SwiGLU()

    @property
    def shared_size(self) -> int:
        if self.shared_intermediate_size is not None:
            return self.shared_intermediate_size
        return self.intermediate_size * self.num_shared_experts

    @property
    def shared_experts_in_batch_problems(self) -> tuple[str, ...]:
        """Why the shared experts cannot be experts of the routed batch
        (shared_experts_path="batch"): () when they can. The kernels' own limits (experts and
        pairs per token) are checked where the layer runs."""
        if not self.num_shared_experts:
            return ("the layer has no shared experts",)
        problems = []
        if self.shared_size % self.intermediate_size:
            problems.append(
                f"the shared experts' intermediate size {self.shared_size} is not a multiple "
                f"of intermediate_size={self.intermediate_size}"
            )
        if self.weight_dtype != self.shared_weight_dtype:
            problems.append(
                f"the routed experts' weight_dtype={self.weight_dtype!r} and the shared experts' "
                f"shared_weight_dtype={self.shared_weight_dtype!r} differ (a batch holds one "
                "precision)"
            )
        elif self.weight_dtype == "fp8" and self.intermediate_size % WEIGHT_BLOCK:
            problems.append(
                f"FP8 shared experts cut into experts of intermediate_size="
                f"{self.intermediate_size} would split their 128 x 128 scale blocks (a multiple "
                "of 128 is needed)"
            )
        if self.latent_size is not None:
            problems.append("latent_size (the batch holds the latent rows)")
        problems.extend(self.expert_math_features)
        return tuple(problems)

    @classmethod
    def from_geometry(cls, geometry: Geometry, **overrides) -> MegaMoEConfig:
        fields = dict(
            hidden_size=geometry.hidden_size,
            intermediate_size=geometry.intermediate_size,
            num_experts=geometry.num_experts,
            top_k=geometry.top_k,
            scoring=geometry.scoring,
            renormalize=geometry.renormalize,
            num_groups=geometry.num_groups,
            top_groups=geometry.top_groups,
            routed_scaling_factor=geometry.routed_scaling_factor,
            use_correction_bias=geometry.use_correction_bias,
            num_shared_experts=geometry.num_shared_experts,
            shared_expert_gate=geometry.shared_expert_gate,
            router_bias=geometry.router_bias,
            expert_bias=geometry.expert_bias,
            swiglu_limit=geometry.swiglu.limit,
            swiglu_alpha=geometry.swiglu.alpha,
            swiglu_up_offset=geometry.swiglu.up_offset,
        )
        fields.update(overrides)
        return cls(**fields)
