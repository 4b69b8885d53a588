"""Routing and dispatch on one GPU (sm_90a): router logits in, the expert-major batch out.

route_and_place, one launch: a grid of CTAs of ROUTE_WARPS warps, no more than are resident at
once (its grid-wide barriers need every CTA resident): route_ctas_per_sm per SM, which the
launch bounds guarantee, on the `sms` SMs of the GPU (at most ROUTE_MAX_CTAS). Each CTA takes a
contiguous share of the tokens, at most `cta_tokens` where the grid has room (a quantizing copy
split between a CTA's warps: the tokens whose slices its warps take in one pass):
1. a warp per token, each warp walking a contiguous slice of the tokens in order: the scores
   and choice scores (RouteRule: softmax over the experts, sigmoid or sqrt(softplus) of each
   logit; each expert chosen on its
   score or its logit, plus its correction bias), the grouped top-k mask (groups scored by the
   sum of their two best choice scores or by their best one, the best `top_groups` kept, the
   others' experts given `dropped_score`), then the top-k in rounds: each takes the
   warp's largest int32 score key (the choice score's bits made order-preserving, NaN above
   every number) in one `redux.sync` and, of the experts that hold it, the lowest id from a
   ballot per register, the order torch.topk ranks them in (ties to the lower expert id; a
   butterfly of int64 (key, id) maxima, 5 shuffle steps a round, took the routing launch 5-13%
   longer at 1-16 qwen3-30b-a3b tokens); the weights are the chosen experts' unbiased scores,
   renormalised (k order, fp32; + 1e-20 for sigmoid and sqrt(softplus)) and scaled. Lane k
   writes topk_ids[t, k] and topk_weights[t, k], and the pair's rank among the warp's pairs of
   its expert so far (per-warp counters in shared memory): a token's experts are distinct, and
   the warp takes its tokens in order, so the ranks follow the (token, k) order;
2. per expert, each warp's exclusive prefix inside the CTA; the CTA's count into the scratch;
3. grid-wide barrier; a warp per expert scans the CTAs' counts (each CTA's exclusive prefix, in
   place) and stores the expert's total (a grid of one CTA, up to `one_cta_tokens` <=
   ROUTE_WARPS tokens, skips the scratch, the barriers and this step: its counts are the
   totals);
4. grid-wide barrier; every CTA scans the experts' totals into their first rows (CTA 0 writes
   expert_offsets) and finishes its pairs' rows: row_of_pair[t, k] = first row of the expert +
   the CTA's prefix + the warp's prefix + the rank in the warp, which is where a stable sort of
   the flattened ids by expert puts pair t x top_k + k;
5. the token rows go into the batch: with `copy_by_token` each warp copies its own tokens, each
   16-byte vector loaded once and stored in the token's top_k rows; without it, after a CTA
   barrier, the CTA's warps copy a pair each (`unroll` 16-byte loads per lane in flight).
   FP8 rows (row_scales given, copy_by_token): each warp quantizes its own tokens as it copies
   them (`unroll` trips of loads in flight), one scale per row and ACTIVATION_GROUP columns
   (row_vectors.quantize_to_rows: fp8_scaling's recipe, the values quantizing each batch row on
   the host gives), so the batch is e4m3 with no pass before it.
   A CTA of fewer than `split_tokens` tokens (decode: a warp or a few would copy while the
   others wait) instead has all its warps take slices of 32 x unroll vectors of its tokens'
   rows, bf16 or e4m3 (step 6, after a CTA barrier: the pairs' rows come from row_of_pair),
   with the same bits.
   Scaled rows (`weights_on_input`, bf16 rows): each pair's row is its token times the pair's
   weight rounded to bf16, each value rounded once to bf16 (row_vectors.scale_to_rows: the
   bits of torch's `x * w.to(torch.bfloat16)`), for experts that compute on w x (Llama 4);
   the combine then sums the pairs unweighted.
   Gathered rows (row_source given, rows None): no row is copied; each pair's lane writes
   row_source[row] = its token instead, and the gate-up GEMM reads the batch rows from the
   tokens (expert_gemm_sm90's gather_rows).
   Row tokens (row_source given beside the rows, and row_weights): each pair's lane also
   writes its row's token and row_weights[row] = its weight, for a down GEMM that adds each
   row, weighted, into its token's output row (expert_gemm_sm90's reduce_out) in place of the
   combine; zero_rows (the output [T, H] bf16, optional): the warp that routed a token zeroes
   its row there, for those adds (no fill launched between this kernel and the GEMMs, which
   would break their programmatic chain).

Given experts (mGivenIds [T, top_k], int32 or int64, in place of the choice of step 1: a model
that routes its tokens itself, or DeepSeek-V4's hash layers, whose token ids choose): lane k takes
expert mGivenIds[t, k] and the weight mGivenWeights[t, k] (float32 or bfloat16) as given, or,
mGivenWeights None, the expert's score from the logits, renormalised and scaled by the rule.
Where the ids name an expert twice in a token its pairs are ranked in k order (`match.any`), as
the stable sort ranks them. An id outside [0, E) is placed as expert 0 with weight 0: no id
reaches memory outside the batch (the caller checks ids where it can afford a host sync). With
given weights there are no logits (mLogits None).

Shared experts in the batch (`shared_experts` S > 0): every token also visits experts E .. E + S
- 1 (a shared MLP cut into S experts of the routed experts' size), as pairs top_k .. top_k + S - 1
of weight 1, after its routed pairs: they are counted, placed and copied like the routed pairs,
so the batch holds E + S experts, the shared ones last, each with every token's row in token
order, and the grouped GEMMs compute them with the routed experts (the combine sums top_k + S
pairs). With a shared gate (shared_gate [T] float32, the logit of Qwen2-MoE's sigmoid gate on
the shared MLP) the shared pairs' weight is sigmoid(shared_gate[t]) in place of 1.

route_tokens is step 1 alone (topk_ids and topk_weights; no placement, no copy, no barrier), for
the expert-parallel dispatchers, which place the pairs themselves.

Both are launched with programmatic dependent launch and wait (griddepcontrol.wait) before their
first read: the kernel that computes the logits (local_router.router_logits) lets them be
scheduled as it starts, and after a kernel that does not signal early the wait returns at once.

Published offsets (`publish_offsets`): the int32 word after expert_offsets (its allocation holds
E + S + 2 words) tells the gate-up GEMM launched after this kernel when the offsets are final,
so that it can start loading the weights of its first tiles before this kernel ends
(expert_gemm_sm90's `polls_offsets`). Thread 0 of CTA 0 sets the word to 0 before its CTA lets
the GEMM launch (the GEMM launches once every CTA has passed launch_dependents; the GEMM of the
launch before this one finished reading the word before the kernels between the two launched),
and to 1, with release semantics, once CTA 0 has stored the offsets.

Layouts: logits [T, E] float32 or bfloat16 (None with given weights); correction_bias [E]
float32 (optional); shared_gate [T] float32 (optional, with S > 0); given ids and weights
[T, top_k] (optional); x [T, H] bfloat16 and rows [M, H] bfloat16 (or e4m3 with row_scales float32 [ceil(H / 128), M],
group-major) row-major, H a multiple of 8, rows 16-byte aligned (or row_source int32 [M] in
their place, or beside them); row_weights float32 [M] and zero_rows bf16 [T, H] row-major
(optional); topk_ids and
row_of_pair int32 [T, top_k + S]; topk_weights float32 [T, top_k + S]; expert_offsets int32
[E + S + 1] (E + S + 2 with publish_offsets); scratch int32 [scratch_words(E + S)], zeroed once when allocated (its barrier words return to their
start state, so launches, graph replays included, need no host work); status int64 [4]: a
barrier wait that times out records (phase + 1, 0, 0, observed) there and carries on.
token_count int32 [1] (optional, token_count.py): the kernel routes, places and copies the
first min(token_count[0], T) tokens alone (their pairs alone in expert_offsets), so a graph of T
token rows serves any count up to T; the grid stays the one T sizes, its CTAs sharing the counted
tokens.
Constraints: E + S <= ROUTE_MAX_EXPERTS, top_k + S <= ROUTE_MAX_TOP_K, T x (top_k + S) <= M
(the caller checks).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.memory import SmemAllocator

from .ep_dispatch import copy_row, copy_to_rows
from .ep_place import grid_barrier, scan_cta_counts
from .ep_sync import thread_position
from .row_vectors import bf16_weight, quantize_to_rows, scale_to_rows, store_chunk
from .token_count import counted_tokens
from .warp import lanes_with_same_value, warp_inclusive_sum

ROUTE_WARPS = 16
ROUTE_THREADS = ROUTE_WARPS * 32
ROUTE_MAX_CTAS = 2 * 132  # two CTAs on each SM of the largest Hopper GPUs
ROUTE_MAX_EXPERTS = 512  # shared memory: 16 warps x E counters fit in 48 KB
ROUTE_MAX_TOP_K = 32
ROUTE_BARRIER_WORDS = 4  # two barriers' arrivals and generations
NO_EXPERT = 1 << 30  # an arg-max that has seen no expert yet
TAKEN_KEY = -(1 << 31)  # below every score_key: an expert already chosen, or none


@dataclass(frozen=True)
class RouteRule:
    """How a token's experts and weights follow from its logits: one compile-time constant of
    the routing kernels (the correction bias is the mBias tensor, or None).

    scoring "softmax" (over the experts), "sigmoid" or "sqrtsoftplus" (sqrt(softplus), of
    each logit): the choice score of an expert is its score, or its logit where
    choice_on_logits, plus its correction bias.
    Grouped top-k (num_groups > 1): each group scored by the sum of its two best choice
    scores, or by its best one where group_by_max; the best top_groups groups kept, the other
    groups' experts given dropped_score. The top_k largest choice scores are chosen, weighted
    by their scores. scoring "sparsemixer" (PhiMoE's, top_k 2, no bias, no groups): two rounds,
    each the largest logit left, weighted by its softmax over the logits left within a relative
    gap of 2 x sparsemixer_eps below it. The weights are then renormalised (+ 1e-20 with
    sigmoid and sqrtsoftplus scores) where renormalize, times scaling."""

    num_experts: int
    top_k: int
    scoring: str
    renormalize: bool
    num_groups: int
    top_groups: int
    group_by_max: bool
    choice_on_logits: bool
    dropped_score: float
    scaling: float
    sparsemixer_eps: float


def route_ctas_per_sm(experts: int, quantizes: bool) -> int:
    """route_and_place's CTAs resident on an SM at once, which its launch bounds guarantee: 2
    at 64 registers a thread (twice the warps routing and copying tokens, each taking half as
    many one after another), up to 128 experts (4 per lane; 256 spill) and bf16 rows; else 1
    (quantizing its rows takes 100 to 124 registers)."""
    return 2 if experts <= 128 and not quantizes else 1


def one_cta_token_limit(num_experts: int, one_cta_tokens: int, cta_tokens: int) -> int:
    """Up to how many tokens route_and_place launches one CTA (its grid rule, on the host):
    such a launch never touches its scratch nor its status block."""
    limit = min(ROUTE_WARPS, one_cta_tokens)
    if num_experts <= ROUTE_WARPS:  # the grid's floor of a warp per expert is one CTA
        limit = max(limit, min(ROUTE_WARPS, cta_tokens))
    return limit


def scratch_words(num_experts: int) -> int:
    """int32 words of scratch route_and_place needs: [E, ROUTE_MAX_CTAS] CTA counts, each
    expert's total, then the barrier words."""
    return num_experts * (ROUTE_MAX_CTAS + 1) + ROUTE_BARRIER_WORDS


@cute.jit
def ranks_above(value, index, other_value, other_index):
    """1 if (other_value, other_index) comes first in top-k order (the larger value, NaN above
    every number, ties to the lower index), else 0."""
    other_nan = cutlass.Int32(0)
    if other_value != other_value:
        other_nan = cutlass.Int32(1)
    value_nan = cutlass.Int32(0)
    if value != value:
        value_nan = cutlass.Int32(1)
    above = cutlass.Int32(0)
    if other_value > value:
        above = cutlass.Int32(1)
    if other_nan != value_nan:
        above = other_nan
    tie = cutlass.Int32(0)
    if other_value == value:
        tie = cutlass.Int32(1)
    if other_nan + value_nan == 2:
        tie = cutlass.Int32(1)
    if tie == 1:
        above = cutlass.Int32(0)
        if other_index < index:
            above = cutlass.Int32(1)
    return above


@cute.jit
def score_key(value):
    """`value` as an int32 whose integer order is top-k order: the larger value first, NaN above
    every number (NaNs equal), -0 equal to +0. The value's bits made order-preserving as a
    signed integer (a negative float's magnitude bits flipped); never TAKEN_KEY."""
    bits = cutlass.Int32(llvm.bitcast(cutlass.Int32.mlir_type, cutlass.Float32(value).ir_value()))
    magnitude = bits & cutlass.Int32(0x7FFFFFFF)
    if magnitude == 0:
        bits = cutlass.Int32(0)  # -0 as +0
    if magnitude > cutlass.Int32(0x7F800000):
        bits = cutlass.Int32(0x7FC00000)  # every NaN as the positive quiet NaN, above +inf
    if bits < 0:
        bits = bits ^ cutlass.Int32(0x7FFFFFFF)
    return bits


@cute.jit
def top_of_two(a, b):
    """The larger of a and b in top-k order (NaN above every number)."""
    top = a
    if ranks_above(a, 0, b, 0) == 1:
        top = b
    return top


@cute.jit
def push_top_two(first, second, value):
    """(first, second) after `value` joins the two largest so far, in top-k order."""
    if ranks_above(first, 0, value, 0) == 1:
        second = first
        first = value
    else:
        second = top_of_two(second, value)
    return first, second


@cute.jit
def warp_top_two_sum(first, second):
    """Sum of the two largest of the warp's (first, second) pairs (top-k order), on every
    lane."""
    for step in cutlass.range_constexpr(5):
        other_first = cute.arch.shuffle_sync_bfly(first, 1 << step)
        other_second = cute.arch.shuffle_sync_bfly(second, 1 << step)
        first, second = push_top_two(first, second, other_first)
        second = top_of_two(second, other_second)
    return first + second


@cute.jit
def warp_sum(value):
    for step in cutlass.range_constexpr(5):
        value = value + cute.arch.shuffle_sync_bfly(value, 1 << step)
    return value


@cute.jit
def warp_max(value):
    for step in cutlass.range_constexpr(5):
        value = cute.arch.fmax(value, cute.arch.shuffle_sync_bfly(value, 1 << step))
    return value


@cute.jit
def sigmoid_of(logit):
    """1 / (1 + exp(-logit)) in fp32: the sigmoid scoring's, and the shared gate's."""
    return cutlass.Float32(1.0) / (cutlass.Float32(1.0) + cute.math.exp(-logit))


@cute.jit
def sqrt_softplus_of(logit):
    """sqrt(softplus(logit)) in fp32, softplus as torch computes it: the logit itself above 20,
    else log1p(exp(logit)) (0 for -inf, NaN for NaN): the sqrtsoftplus scoring's."""
    softplus = logit
    if logit <= cutlass.Float32(20.0):
        softplus = cute.math.log1p(cute.math.exp(logit))
    return cute.math.sqrt(softplus)


@cute.jit
def warp_top(value):
    """The largest of the warp's values in top-k order (NaN above every number), on every
    lane."""
    for step in cutlass.range_constexpr(5):
        value = top_of_two(value, cute.arch.shuffle_sync_bfly(value, 1 << step))
    return value


@cute.jit
def choice_score(score, logit, mBias, expert, rule: cutlass.Constexpr):
    """What `expert` is chosen on: its score, or its logit where rule.choice_on_logits, plus its
    correction bias (mBias, or None). Past the experts (never chosen: their keys are TAKEN_KEY,
    and in no group) -inf, or a softmax score's 0."""
    choice = score
    if cutlass.const_expr(rule.choice_on_logits):
        choice = logit
    if cutlass.const_expr(mBias is not None):
        if expert < rule.num_experts:
            choice = choice + mBias[expert]
    if cutlass.const_expr(rule.scoring != "softmax" or rule.choice_on_logits or mBias is not None):
        if expert >= rule.num_experts:
            choice = cutlass.Float32(-float("inf"))
    return choice


@cute.jit
def score_token(mLogits, mBias, token, lane, rule: cutlass.Constexpr):
    """Lane l's scores and choice scores of experts l, l + 32, ... (lists, -inf past E)."""
    num_experts = rule.num_experts
    per_lane = (num_experts + 31) // 32
    minus_inf = cutlass.Float32(-float("inf"))
    logits = []
    for j in cutlass.range_constexpr(per_lane):
        logit = minus_inf
        if lane + 32 * j < num_experts:
            logit = cutlass.Float32(mLogits[token, lane + 32 * j])
        logits.append(logit)
    scores = []
    choices = []
    if cutlass.const_expr(rule.scoring == "softmax"):
        largest = logits[0]
        for j in cutlass.range_constexpr(1, per_lane):
            largest = cute.arch.fmax(largest, logits[j])
        largest = warp_max(largest)
        exps = []
        local_sum = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(per_lane):
            value = cutlass.Float32(0.0)
            if lane + 32 * j < num_experts:
                value = cute.math.exp(logits[j] - largest)
            exps.append(value)
            local_sum = local_sum + value
        total = warp_sum(local_sum)
        for j in cutlass.range_constexpr(per_lane):
            score = exps[j] / total
            scores.append(score)
            choices.append(choice_score(score, logits[j], mBias, lane + 32 * j, rule))
    else:
        for j in cutlass.range_constexpr(per_lane):
            if cutlass.const_expr(rule.scoring == "sigmoid"):
                score = sigmoid_of(logits[j])
            else:
                score = sqrt_softplus_of(logits[j])
            scores.append(score)
            choices.append(choice_score(score, logits[j], mBias, lane + 32 * j, rule))
    if cutlass.const_expr(rule.num_groups > 1):
        group_size = num_experts // rule.num_groups
        group_scores = []
        for g in cutlass.range_constexpr(rule.num_groups):
            first = minus_inf
            second = minus_inf
            for j in cutlass.range_constexpr(per_lane):
                if (lane + 32 * j) // group_size == g:
                    if cutlass.const_expr(rule.group_by_max):
                        first = top_of_two(first, choices[j])
                    else:
                        first, second = push_top_two(first, second, choices[j])
            if cutlass.const_expr(rule.group_by_max):
                group_scores.append(warp_top(first))
            else:
                group_scores.append(warp_top_two_sum(first, second))
        kept = cutlass.Int32(0)
        for _ in cutlass.range_constexpr(rule.top_groups):
            best = minus_inf
            best_group = cutlass.Int32(NO_EXPERT)
            for g in cutlass.range_constexpr(rule.num_groups):
                if ((kept >> g) & 1) == 0:
                    if ranks_above(best, best_group, group_scores[g], cutlass.Int32(g)) == 1:
                        best = group_scores[g]
                        best_group = cutlass.Int32(g)
            kept = kept | (cutlass.Int32(1) << best_group)
        masked = []
        for j in cutlass.range_constexpr(per_lane):
            choice = choices[j]
            group = (lane + 32 * j) // group_size
            if lane + 32 * j < num_experts:
                if ((kept >> group) & 1) == 0:
                    choice = cutlass.Float32(rule.dropped_score)
            masked.append(choice)
        choices = masked
    return scores, choices


@cute.jit
def largest_key_owner(keys, per_lane: cutlass.Constexpr):
    """The expert holding the warp's largest key (lane l's keys[j] is expert l + 32 j's), the
    lowest id among equal ones, on every lane: the largest by `redux.sync` over each lane's
    largest, then the lowest lane of the first register j whose ballot of `key == largest` is
    not empty."""
    best = keys[0]
    for j in cutlass.range_constexpr(1, per_lane):
        best = cutlass.max(best, keys[j])
    largest = cute.arch.warp_redux_sync(best, "max")
    ballots = []
    for j in cutlass.range_constexpr(per_lane):
        ballots.append(cute.arch.vote_ballot_sync(keys[j] == largest))
    # the first register with a holder, from the last down
    ballot = ballots[per_lane - 1]
    first_register = cutlass.Int32(per_lane - 1)
    for j in cutlass.range_constexpr(per_lane - 2, -1, -1):
        if ballots[j] != 0:
            ballot = ballots[j]
            first_register = cutlass.Int32(j)
    return cutlass.Int32(cute.arch.clz(cute.arch.brev(ballot))) + 32 * first_register


@cute.jit
def choose_top_k(scores, choices, lane, num_experts: cutlass.Constexpr, top_k: cutlass.Constexpr):
    """Lane k < top_k's k-th expert (by choice score, top-k order) and its score: top_k rounds,
    each the expert holding the warp's largest score_key (largest_key_owner: every lane learns
    it; NaN above every number, ties to the lower id), whose lane then drops its key. Then each
    lane reads its expert's score from the lane that holds it."""
    per_lane = (num_experts + 31) // 32
    keys = []
    for j in cutlass.range_constexpr(per_lane):
        key = cutlass.Int32(TAKEN_KEY)
        if lane + 32 * j < num_experts:
            key = score_key(choices[j])
        keys.append(key)
    my_expert = cutlass.Int32(0)
    for k in cutlass.range_constexpr(top_k):
        expert = largest_key_owner(keys, per_lane)
        for j in cutlass.range_constexpr(per_lane):
            if lane + 32 * j == expert:
                keys[j] = cutlass.Int32(TAKEN_KEY)
        if lane == k:
            my_expert = expert
    my_score = cutlass.Float32(0.0)
    for j in cutlass.range_constexpr(per_lane):
        score = cute.arch.shuffle_sync(scores[j], my_expert % 32)
        if my_expert // 32 == j:
            my_score = score
    return my_expert, my_score


@cute.jit
def sparsemixer_token(mLogits, token, lane, rule: cutlass.Constexpr):
    """Lane k < 2's k-th expert of `token` by PhiMoE's sparsemixer (RouteRule) and its weight:
    each round takes the largest logit left (the lowest id among equal ones) and weighs it by
    its softmax over the logits left within a relative gap of 2 x sparsemixer_eps below it,
    ((largest - l) / max(|l|, largest) <= 2 eps), as 1 / the sum of their exp(l - largest)."""
    num_experts = rule.num_experts
    per_lane = (num_experts + 31) // 32
    gap = cutlass.Float32(2 * rule.sparsemixer_eps)
    logits = []
    keys = []
    for j in cutlass.range_constexpr(per_lane):
        logit = cutlass.Float32(-float("inf"))
        key = cutlass.Int32(TAKEN_KEY)
        if lane + 32 * j < num_experts:
            logit = cutlass.Float32(mLogits[token, lane + 32 * j])
            key = score_key(logit)
        logits.append(logit)
        keys.append(key)
    my_expert = cutlass.Int32(0)
    my_weight = cutlass.Float32(0.0)
    for k in cutlass.range_constexpr(2):
        expert = largest_key_owner(keys, per_lane)
        largest = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(per_lane):
            value = cute.arch.shuffle_sync(logits[j], expert % 32)
            if expert // 32 == j:
                largest = value
        local_sum = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(per_lane):
            if keys[j] != cutlass.Int32(TAKEN_KEY):
                # left out past the gap; NaN (0 / 0: the largest logit 0) keeps it, as in torch
                term = cute.math.exp(logits[j] - largest)
                magnitude = cute.arch.fmax(cute.arch.fmax(logits[j], -logits[j]), largest)
                if (largest - logits[j]) / magnitude > gap:
                    term = cutlass.Float32(0.0)
                local_sum = local_sum + term
        weight = cutlass.Float32(1.0) / warp_sum(local_sum)
        for j in cutlass.range_constexpr(per_lane):
            if lane + 32 * j == expert:
                keys[j] = cutlass.Int32(TAKEN_KEY)
        if lane == k:
            my_expert = expert
            my_weight = weight
    return my_expert, my_weight


@cute.jit
def route_token(mLogits, mBias, token, lane, rule: cutlass.Constexpr):
    """Lane k < top_k's k-th expert of `token` and its final weight (renormalised, scaled)."""
    if cutlass.const_expr(rule.scoring == "sparsemixer"):
        expert, weight = sparsemixer_token(mLogits, token, lane, rule)
    else:
        scores, choices = score_token(mLogits, mBias, token, lane, rule)
        expert, weight = choose_top_k(scores, choices, lane, rule.num_experts, rule.top_k)
    return expert, finished_weight(weight, rule)


@cute.jit
def finished_weight(weight, rule: cutlass.Constexpr):
    """Lane k < top_k's weight renormalised over the top_k lanes' (k order, fp32; + 1e-20 with
    sigmoid and sqrt(softplus) scores) where rule.renormalize, then times rule.scaling."""
    if cutlass.const_expr(rule.renormalize):
        denominator = cutlass.Float32(0.0)
        for k in cutlass.range_constexpr(rule.top_k):
            denominator = denominator + cute.arch.shuffle_sync(weight, k)
        if cutlass.const_expr(rule.scoring in ("sigmoid", "sqrtsoftplus")):
            denominator = denominator + cutlass.Float32(1e-20)
        weight = weight / denominator
    if cutlass.const_expr(rule.scaling != 1.0):
        weight = weight * cutlass.Float32(rule.scaling)
    return weight


@cute.jit
def given_pair(mLogits, mGivenIds, mGivenWeights, token, lane, rule: cutlass.Constexpr):
    """Lane k < top_k's expert of `token` as given, mGivenIds[token, k], and its weight:
    mGivenWeights[token, k] as given, or (mGivenWeights None) the expert's score from the
    logits, renormalised and scaled as route_token's weights are (the correction bias and the
    groups, which only choose, play no part). An id outside [0, E) becomes expert 0 with
    weight 0 (left out of the renormalisation): no id addresses memory outside the batch."""
    expert = cutlass.Int32(0)
    valid = cutlass.Boolean(False)
    if lane < rule.top_k:
        given = mGivenIds[token, lane]
        if given >= 0:
            if given < rule.num_experts:
                expert = cutlass.Int32(given)
                valid = cutlass.Boolean(True)
    weight = cutlass.Float32(0.0)
    if cutlass.const_expr(mGivenWeights is not None):
        if valid:
            weight = cutlass.Float32(mGivenWeights[token, lane])
    else:
        scores, _ = score_token(mLogits, None, token, lane, rule)
        picked = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr((rule.num_experts + 31) // 32):
            score = cute.arch.shuffle_sync(scores[j], expert % 32)
            if expert // 32 == j:
                picked = score
        if valid:
            weight = picked
        weight = finished_weight(weight, rule)
    return expert, weight


@cute.jit
def write_row_vectors(
    mX,
    mRows,
    mRowScales,
    token,
    rows,
    first,
    end,
    lane,
    pairs: cutlass.Constexpr,
    unroll: cutlass.Constexpr,
):
    """A warp writes 16-byte vectors [first, end) of `token`'s row into its pair rows `rows`:
    copied (bf16 rows), or quantized with their groups' scales (e4m3 rows); first a multiple of
    32 x unroll vectors (whole quantization groups), end that or the row's end."""
    hidden = mX.shape[1]
    row_bytes = cutlass.Int64(hidden) * 2
    source = mX.iterator.toint() + cutlass.Int64(token) * row_bytes
    if cutlass.const_expr(mRowScales is not None):
        quantize_to_rows(
            source,
            mRows.iterator.toint(),
            rows,
            mRowScales.iterator,
            cutlass.Int64(mRowScales.shape[1]),
            1,
            hidden,
            first,
            end,
            lane,
            pairs,
            unroll,
        )
    else:
        copy_to_rows(
            source, mRows.iterator.toint(), rows, row_bytes, first, end, lane, unroll, pairs
        )


@cute.kernel
def route_and_place_kernel(
    mLogits,
    mBias,
    mSharedGate,
    mGivenIds,
    mGivenWeights,
    mX: cute.Tensor,
    mTopkIds: cute.Tensor,
    mTopkWeights: cute.Tensor,
    mRowOfPair: cute.Tensor,
    mExpertOffsets: cute.Tensor,
    mRows,
    mRowScales,
    mRowSource,
    mRowWeights,
    mZeroRows,
    mScratch: cute.Tensor,
    mStatus: cute.Tensor,
    mTokenCount,
    rule: cutlass.Constexpr,
    unroll: cutlass.Constexpr,
    copy_by_token: cutlass.Constexpr,
    timeout_ns: cutlass.Constexpr,
    shared_experts: cutlass.Constexpr,
    weights_on_input: cutlass.Constexpr,
    split_tokens: cutlass.Constexpr,
    publish_offsets: cutlass.Constexpr,
):
    tidx, bidx, grid, warp, lane = thread_position()
    # the routed experts, then the shared ones; each token's routed pairs, then its shared ones
    experts = rule.num_experts + shared_experts
    pairs = rule.top_k + shared_experts
    # the word after expert_offsets: 1 once they are final (publish_offsets)
    offsets_ready = mExpertOffsets.iterator + (experts + 1)
    if cutlass.const_expr(publish_offsets):
        if bidx == 0:
            if tidx == 0:
                cute.arch.store(offsets_ready, cutlass.Int32(0))
                cute.arch.fence_acq_rel_gpu()
        # no thread of CTA 0 lets the GEMM launch before the word is 0
        cute.arch.sync_threads()
    # the kernel after this one (the gate-up GEMM, launched with programmatic dependent launch)
    # may set up on the SMs this grid leaves; it waits for this grid to finish before it reads
    # anything (but the offsets, once published). Every CTA of this grid is resident once all
    # have passed here
    cute.arch.griddepcontrol_launch_dependents()
    # launched with programmatic dependent launch too: the kernel before this one (the router
    # logits kernel) lets this grid be scheduled early; wait for it (and, through it, every
    # earlier kernel: x) to finish before reading the logits. After a kernel that does not
    # signal early this returns at once
    cute.arch.griddepcontrol_wait()
    tokens = counted_tokens(mX.shape[0], mTokenCount)
    hidden = mX.shape[1]
    smem = SmemAllocator()
    # per-warp counters, then per-warp prefixes, per expert; each expert's first row; the CTA's
    # prefix and the total per expert
    warp_counts = smem.allocate_tensor(cutlass.Int32, cute.make_layout(ROUTE_WARPS * experts), 16)
    first_row = smem.allocate_tensor(cutlass.Int32, cute.make_layout(experts + 1), 16)
    cta_prefix = smem.allocate_tensor(cutlass.Int32, cute.make_layout(experts), 16)
    totals = smem.allocate_tensor(cutlass.Int32, cute.make_layout(experts), 16)

    scratch = mScratch.iterator
    cta_counts = scratch  # [E, ROUTE_MAX_CTAS]
    expert_totals = scratch + ROUTE_MAX_CTAS * experts
    barrier = expert_totals + experts
    status_address = mStatus.iterator.toint()

    # this warp's contiguous tokens (CTA b: tokens [b x per_cta, ...))
    per_cta = (tokens + grid - 1) // grid
    per_warp = (per_cta + ROUTE_WARPS - 1) // ROUTE_WARPS
    cta_begin = bidx * per_cta
    cta_end = cta_begin + per_cta
    if cta_end > tokens:
        cta_end = tokens
    warp_begin = cta_begin + warp * per_warp
    warp_end = warp_begin + per_warp
    if warp_end > cta_end:
        warp_end = cta_end

    for i in range(tidx, ROUTE_WARPS * experts, ROUTE_THREADS):
        warp_counts[i] = cutlass.Int32(0)
    cute.arch.sync_threads()

    # 1. route each token (or take its given experts); rank its pairs inside their experts
    #    among the warp's pairs
    for token in range(warp_begin, warp_end):
        if cutlass.const_expr(mGivenIds is not None):
            expert, weight = given_pair(mLogits, mGivenIds, mGivenWeights, token, lane, rule)
        else:
            expert, weight = route_token(
                mLogits,
                mBias,
                token,
                lane,
                rule,
            )
        if cutlass.const_expr(shared_experts > 0):
            if lane >= rule.top_k:
                expert = rule.num_experts + lane - rule.top_k
                weight = cutlass.Float32(1.0)
                if cutlass.const_expr(mSharedGate is not None):
                    weight = sigmoid_of(cutlass.Float32(mSharedGate[token]))
        if cutlass.const_expr(mGivenIds is not None):
            # given ids may name an expert twice in a token: its pairs ranked in k order
            key = expert
            if lane >= pairs:
                key = -1 - lane
            same = lanes_with_same_value(key)
            before = cute.arch.popc(same & ((cutlass.Int32(1) << lane) - 1))
            rank = cutlass.Int32(0)
            if lane < pairs:
                mTopkIds[token, lane] = expert
                mTopkWeights[token, lane] = weight
                rank = warp_counts[warp * experts + expert] + before
                mRowOfPair[token, lane] = rank  # finished in step 4
            cute.arch.sync_warp()
            if lane < pairs:
                if cute.arch.popc(same) == before + 1:  # the last pair of its expert
                    warp_counts[warp * experts + expert] = rank + 1
        else:
            if lane < pairs:
                mTopkIds[token, lane] = expert
                mTopkWeights[token, lane] = weight
                rank = warp_counts[warp * experts + expert]
                warp_counts[warp * experts + expert] = rank + 1
                mRowOfPair[token, lane] = rank  # finished in step 4
        cute.arch.sync_warp()
    cute.arch.sync_threads()

    # 2. per expert: each warp's exclusive prefix inside the CTA; the CTA's count to the
    #    scratch (a grid of one CTA: its counts are the totals, kept in shared memory)
    for expert in range(tidx, experts, ROUTE_THREADS):
        running = cutlass.Int32(0)
        for w in cutlass.range_constexpr(ROUTE_WARPS):
            count = warp_counts[w * experts + expert]
            warp_counts[w * experts + expert] = running
            running = running + count
        if grid == 1:
            totals[expert] = running
            cta_prefix[expert] = cutlass.Int32(0)
        else:
            cute.arch.store(cta_counts + (expert * ROUTE_MAX_CTAS + bidx), running)
    if grid > 1:
        grid_barrier(barrier, barrier + 1, grid, status_address, 0, 0, timeout_ns)

        # 3. a warp per expert: each CTA's exclusive prefix (in place), the expert's total
        for expert in range(bidx * ROUTE_WARPS + warp, experts, grid * ROUTE_WARPS):
            carry = scan_cta_counts(cta_counts + expert * ROUTE_MAX_CTAS, grid, lane)
            if lane == 0:
                cute.arch.store(expert_totals + expert, carry)
        grid_barrier(barrier + 2, barrier + 3, grid, status_address, 1, 0, timeout_ns)
        for expert in range(tidx, experts, ROUTE_THREADS):
            cta_prefix[expert] = cute.arch.load(
                cta_counts + (expert * ROUTE_MAX_CTAS + bidx), cutlass.Int32, cop="cg"
            )
            totals[expert] = cute.arch.load(expert_totals + expert, cutlass.Int32, cop="cg")
    cute.arch.sync_threads()

    # 4. the experts' first rows (warp 0 scans their totals), then the pairs' rows
    if warp == 0:
        carry = cutlass.Int32(0)
        for group in range(0, experts, 32):
            expert = group + lane
            rows = cutlass.Int32(0)
            if expert < experts:
                rows = totals[expert]
            inclusive = warp_inclusive_sum(rows, lane)
            if expert < experts:
                first_row[expert] = carry + inclusive - rows
            carry = carry + cute.arch.shuffle_sync(inclusive, 31)
        if lane == 0:
            first_row[experts] = carry
    cute.arch.sync_threads()
    if bidx == 0:
        for expert in range(tidx, experts + 1, ROUTE_THREADS):
            mExpertOffsets[expert] = first_row[expert]
        if cutlass.const_expr(publish_offsets):
            # every thread's offsets, then the word (a release: cumulative over the CTA's
            # stores the barrier ordered before it, so the GEMM's acquire reads them)
            cute.arch.sync_threads()
            if tidx == 0:
                cute.arch.store(offsets_ready, cutlass.Int32(1), sem="release", scope="gpu")
    row_bytes = cutlass.Int64(hidden) * 2
    row_vectors = hidden // 8
    x_address = mX.iterator.toint()
    rows_address = cutlass.Int64(0)
    if cutlass.const_expr(mRows is not None):
        rows_address = mRows.iterator.toint()
    # a CTA of fewer than split_tokens tokens (decode) splits each row between its warps (step
    # 6) instead of leaving each token's row to the one warp that routed it
    # (scaled rows are always copied by the warp that routed the token)
    can_split = copy_by_token and mRows is not None and not weights_on_input
    split_rows = cutlass.Boolean(False)
    if cutlass.const_expr(can_split):
        split_rows = cta_end - cta_begin < split_tokens
    for token in range(warp_begin, warp_end):
        row = cutlass.Int32(-1)
        weight = cutlass.Float32(0.0)
        if lane < pairs:
            expert = mTopkIds[token, lane]
            row = first_row[expert] + cta_prefix[expert] + warp_counts[warp * experts + expert]
            row = row + mRowOfPair[token, lane]
            mRowOfPair[token, lane] = row
            if cutlass.const_expr(weights_on_input):
                weight = bf16_weight(mTopkWeights[token, lane])
            if cutlass.const_expr(mRowSource is not None):
                mRowSource[row] = token
            if cutlass.const_expr(mRowWeights is not None):
                mRowWeights[row] = mTopkWeights[token, lane]
        if cutlass.const_expr(mZeroRows is not None):
            zeros = cute.make_rmem_tensor(8, cutlass.Float32)
            zeros.fill(0.0)
            zero_row = mZeroRows.iterator.toint() + cutlass.Int64(token) * row_bytes
            for vector in range(lane, row_vectors, 32):
                store_chunk(zero_row + cutlass.Int64(vector) * 16, zeros)
        if cutlass.const_expr(copy_by_token and mRows is not None):
            if not split_rows:
                # 5. the warp copies the token's row into its batch rows: each 16-byte vector
                #    loaded once, stored once per pair
                rows = []
                for k in cutlass.range_constexpr(pairs):
                    rows.append(cute.arch.shuffle_sync(row, k))
                if cutlass.const_expr(weights_on_input):
                    weights = []
                    for k in cutlass.range_constexpr(pairs):
                        weights.append(cute.arch.shuffle_sync(weight, k))
                    scale_to_rows(
                        x_address + cutlass.Int64(token) * row_bytes,
                        rows_address,
                        rows,
                        weights,
                        row_bytes,
                        row_vectors,
                        lane,
                        pairs,
                    )
                else:
                    write_row_vectors(
                        mX, mRows, mRowScales, token, rows, 0, row_vectors, lane, pairs, unroll
                    )
    if cutlass.const_expr(can_split):
        if split_rows:
            # 6. the CTA's warps take slices of 32 x unroll vectors (whole quantization groups) of
            #    its tokens' rows, each with its token's pair rows from mRowOfPair (written in step
            #    4 by the warp that routed it)
            cute.arch.sync_threads()
            # the last slice may be partial: with unroll 1 a row need not be whole trips of 32
            slice_vectors = 32 * unroll
            slices = (row_vectors + slice_vectors - 1) // slice_vectors
            for item in range(warp, (cta_end - cta_begin) * slices, ROUTE_WARPS):
                token = cta_begin + item // slices
                first = (item - (token - cta_begin) * slices) * slice_vectors
                rows = []
                for k in cutlass.range_constexpr(pairs):
                    rows.append(mRowOfPair[token, k])
                write_row_vectors(
                    mX,
                    mRows,
                    mRowScales,
                    token,
                    rows,
                    first,
                    cutlass.min(first + slice_vectors, row_vectors),
                    lane,
                    pairs,
                    unroll,
                )
    if cutlass.const_expr(not copy_by_token and mRows is not None):
        # 5. a warp per pair of this CTA copies its token's row into the batch
        cute.arch.sync_threads()
        for pair in range(cta_begin * pairs + warp, cta_end * pairs, ROUTE_WARPS):
            token = pair // pairs
            if cutlass.const_expr(weights_on_input):
                scale_to_rows(
                    x_address + cutlass.Int64(token) * row_bytes,
                    rows_address,
                    [mRowOfPair[token, pair - token * pairs]],
                    [bf16_weight(mTopkWeights[token, pair - token * pairs])],
                    row_bytes,
                    row_vectors,
                    lane,
                    1,
                )
            else:
                copy_row(
                    x_address + cutlass.Int64(token) * row_bytes,
                    rows_address
                    + cutlass.Int64(mRowOfPair[token, pair - token * pairs]) * row_bytes,
                    0,
                    row_vectors,
                    lane,
                    unroll,
                )


@cute.jit
def route_and_place(
    mLogits,
    mBias,
    mSharedGate,
    mGivenIds,
    mGivenWeights,
    mX: cute.Tensor,
    mTopkIds: cute.Tensor,
    mTopkWeights: cute.Tensor,
    mRowOfPair: cute.Tensor,
    mExpertOffsets: cute.Tensor,
    mRows,
    mRowScales,
    mRowSource,
    mRowWeights,
    mZeroRows,
    mScratch: cute.Tensor,
    mStatus: cute.Tensor,
    mTokenCount,
    rule: cutlass.Constexpr,
    unroll: cutlass.Constexpr,
    copy_by_token: cutlass.Constexpr,
    timeout_ns: cutlass.Constexpr,
    one_cta_tokens: cutlass.Constexpr,
    shared_experts: cutlass.Constexpr,
    weights_on_input: cutlass.Constexpr,
    split_tokens: cutlass.Constexpr,
    cta_tokens: cutlass.Constexpr,
    publish_offsets: cutlass.Constexpr,
    sms: cutlass.Constexpr,
    stream,
):
    # a warp per token, as many CTAs as that fills, at most as many as are resident; one
    # CTA up to `one_cta_tokens` tokens (no grid barrier; its SM copies every row), else at
    # least a warp per expert, so the scan of step 3 takes one expert per warp, not several one
    # after another, and at most `cta_tokens` tokens a CTA (one_cta_token_limit: up to how many
    # tokens this makes one CTA)
    tokens = mX.shape[0]
    grid = (tokens + ROUTE_WARPS - 1) // ROUTE_WARPS
    expert_ctas = (rule.num_experts + shared_experts + ROUTE_WARPS - 1) // ROUTE_WARPS
    if tokens > one_cta_tokens and grid < expert_ctas:
        grid = expert_ctas
    if cutlass.const_expr(cta_tokens < ROUTE_WARPS):
        by_share = (tokens + cta_tokens - 1) // cta_tokens
        if tokens > one_cta_tokens and grid < by_share:
            grid = by_share
    ctas_per_sm = route_ctas_per_sm(rule.num_experts + shared_experts, mRowScales is not None)
    resident = min(sms * ctas_per_sm, ROUTE_MAX_CTAS)
    if grid > resident:
        grid = resident
    if grid < 1:
        grid = 1
    route_and_place_kernel(
        mLogits,
        mBias,
        mSharedGate,
        mGivenIds,
        mGivenWeights,
        mX,
        mTopkIds,
        mTopkWeights,
        mRowOfPair,
        mExpertOffsets,
        mRows,
        mRowScales,
        mRowSource,
        mRowWeights,
        mZeroRows,
        mScratch,
        mStatus,
        mTokenCount,
        rule,
        unroll,
        copy_by_token,
        timeout_ns,
        shared_experts,
        weights_on_input,
        split_tokens,
        publish_offsets,
    ).launch(
        grid=[grid, 1, 1],
        block=[ROUTE_THREADS, 1, 1],
        stream=stream,
        use_pdl=True,
        # launch bounds: at most 65536 / (ctas_per_sm x ROUTE_THREADS) registers a thread
        max_number_threads=[ROUTE_THREADS, 1, 1],
        min_blocks_per_mp=ctas_per_sm,
        # most of the SM's memory as shared memory, so that ctas_per_sm CTAs' counters fit
        # (given, the compile does not ask a GPU for a default)
        preferred_smem_carveout=100,
    )


@cute.kernel
def route_tokens_kernel(
    mLogits: cute.Tensor,
    mBias,
    mTopkIds: cute.Tensor,
    mTopkWeights: cute.Tensor,
    rule: cutlass.Constexpr,
):
    _, bidx, _, warp, lane = thread_position()
    # launched with programmatic dependent launch, as route_and_place is
    cute.arch.griddepcontrol_wait()
    token = bidx * ROUTE_WARPS + warp
    if token < mLogits.shape[0]:
        expert, weight = route_token(
            mLogits,
            mBias,
            token,
            lane,
            rule,
        )
        if lane < rule.top_k:
            mTopkIds[token, lane] = expert
            mTopkWeights[token, lane] = weight


@cute.jit
def route_tokens(
    mLogits: cute.Tensor,
    mBias,
    mTopkIds: cute.Tensor,
    mTopkWeights: cute.Tensor,
    rule: cutlass.Constexpr,
    stream,
):
    """Step 1 of route_and_place alone: topk_ids and topk_weights, a warp per token (for the
    expert-parallel dispatchers, which place the pairs themselves)."""
    grid = (mLogits.shape[0] + ROUTE_WARPS - 1) // ROUTE_WARPS
    if grid < 1:
        grid = 1
    route_tokens_kernel(
        mLogits,
        mBias,
        mTopkIds,
        mTopkWeights,
        rule,
    ).launch(grid=[grid, 1, 1], block=[ROUTE_THREADS, 1, 1], stream=stream, use_pdl=True)
