"""Router: scores from logits, then top-k experts per token with their weights.

Shape legend: T tokens, E experts, K experts per token (top-k).

Semantics follow the model families megamoe serves:
- softmax (Mixtral, Qwen2/3-MoE): softmax over E in fp32, top-k, optionally renormalised so the K
  weights sum to one. Renormalised, these are also the weights of a softmax over the K largest
  logits (gpt-oss, Granite-MoE, Aria compute it that way): the same numbers up to rounding.
  With a correction bias (ERNIE 4.5), the choice is made on softmax + bias, the weights are the
  unbiased probabilities.
- sigmoid (DeepSeek-V3): sigmoid scores; a per-expert correction bias is added for *choosing*
  experts only; experts are split into groups, each group scored by the sum of its two best biased
  scores, the best `top_groups` groups kept; top-k among their experts; the weights are the
  unbiased scores, optionally renormalised, times `routed_scaling_factor`.
- sqrtsoftplus (DeepSeek-V4): sqrt(softplus(logit)) scores, chosen and weighted as sigmoid ones
  are (the correction bias for the choice only, + 1e-20 in the renormalisation); torch's
  softplus, which returns the logit itself above 20.
  Experts of the groups not kept get the choice score `dropped_group_score`: -inf (never chosen,
  as DeepSeek's reference and current transformers do) or 0.0 (transformers before its 2026 fix,
  which picks them over kept experts whose biased scores are negative).
- grouped top-k with `group_score="max"` (DeepSeek-V2's group-limited greedy): a group is scored by
  its best expert instead of its two best; any scoring.
- `choice_on_logits` (Kolibri): the experts are chosen on the logits plus the correction bias
  rather than on the scores plus it; the weights are the scores, as above. Without a bias the
  two choices are the same (both scorings keep the logits' order).
- sparsemixer (PhiMoE, inference): two rounds, each taking the largest logit not yet taken;
  its weight is its probability in a softmax over the logits not yet taken that lie within a
  relative gap of 2 x `sparsemixer_eps` below it (a logit l is left out where (m - l) /
  max(|l|, m) > 2 eps, m the round's largest). top_k = 2, no bias and no groups; PhiMoE does not
  renormalise. (Training samples the experts instead: megamoe computes inference's choice.)

Non-finite logits are not checked on the hot path (that would need a host sync): a token whose
logits hold NaN gets NaN weights, so its output row is NaN and no other token is affected. Pass
`check_finite=True` to raise instead (a host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Scoring = Literal["softmax", "sigmoid", "sqrtsoftplus", "sparsemixer"]
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus", "sparsemixer")
GroupScore = Literal["top2_sum", "max"]
GROUP_SCORES = ("top2_sum", "max")


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: Scoring = "softmax"
    renormalize: bool = True
    num_groups: int = 1
    top_groups: int = 1
    routed_scaling_factor: float = 1.0
    use_correction_bias: bool = False
    # choice score of the experts in groups not kept (see the module docstring)
    dropped_group_score: float = float("-inf")
    # how a group is scored for grouped top-k: the sum of its two best choice scores (DeepSeek-V3)
    # or its best one (DeepSeek-V2)
    group_score: GroupScore = "top2_sum"
    # choose on logits + correction bias instead of scores + correction bias (the module docstring)
    choice_on_logits: bool = False
    # scoring="sparsemixer": the relative gap below a round's largest logit, in units of 2 x this,
    # past which a logit is left out of the round's softmax (PhiMoE's router_jitter_noise)
    sparsemixer_eps: float = 0.01

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "num_groups", "top_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}"
            )
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.scoring == "sparsemixer":
            other = [
                name
                for name, used in (
                    ("top_k != 2", self.top_k != 2),
                    ("a correction bias", self.use_correction_bias),
                    ("grouped top-k", self.num_groups > 1),
                    ("choice_on_logits", self.choice_on_logits),
                )
                if used
            ]
            if other:
                raise ValueError(
                    f"scoring='sparsemixer' chooses two experts on the logits alone, got "
                    f"{', '.join(other)}"
                )
            if not self.sparsemixer_eps >= 0:
                raise ValueError(f"sparsemixer_eps must be >= 0, got {self.sparsemixer_eps}")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(
                f"num_groups must be >= 1 and divide num_experts={self.num_experts}, "
                f"got {self.num_groups}"
            )
        if not 1 <= self.top_groups <= self.num_groups:
            raise ValueError(
                f"top_groups must be in [1, num_groups={self.num_groups}], got {self.top_groups}"
            )
        experts_in_kept_groups = self.top_groups * (self.num_experts // self.num_groups)
        if self.top_k > experts_in_kept_groups:
            raise ValueError(
                f"top_k={self.top_k} exceeds the {experts_in_kept_groups} experts in the "
                f"top_groups={self.top_groups} kept groups"
            )
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        if (
            self.num_groups > 1
            and self.group_score == "top2_sum"
            and self.num_experts // self.num_groups < 2
        ):
            raise ValueError(
                "group_score='top2_sum' scores a group by its two best experts: need >= 2 per group"
            )
        if self.dropped_group_score not in (float("-inf"), 0.0):
            raise ValueError(
                f"dropped_group_score must be -inf or 0.0, got {self.dropped_group_score}"
            )


def route(
    router_logits_TE: torch.Tensor,
    config: RouterConfig,
    *,
    correction_bias_E: torch.Tensor | None = None,
    check_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (topk_ids_TK int32, topk_weights_TK float32). No host sync unless `check_finite`."""
    if router_logits_TE.dim() != 2 or router_logits_TE.shape[1] != config.num_experts:
        raise ValueError(
            f"router_logits must have shape [tokens, num_experts={config.num_experts}], "
            f"got {tuple(router_logits_TE.shape)}"
        )
    if not router_logits_TE.is_floating_point():
        raise TypeError(f"router_logits must be floating point, got {router_logits_TE.dtype}")
    if config.use_correction_bias and correction_bias_E is None:
        raise ValueError("config.use_correction_bias is set but no correction_bias_E was given")
    if check_finite:
        check_finite_logits(router_logits_TE)
    logits_TE = router_logits_TE.float()
    if config.scoring == "sparsemixer":
        topk_ids_TK, topk_weights_TK = _sparsemixer(logits_TE, config.sparsemixer_eps)
    else:
        topk_ids_TK, topk_weights_TK = _top_k_scores(logits_TE, config, correction_bias_E)
    return topk_ids_TK.to(torch.int32), _renormalized_and_scaled(topk_weights_TK, config)


def weights_of_chosen(
    router_logits_TE: torch.Tensor, topk_ids_TK: torch.Tensor, config: RouterConfig
) -> torch.Tensor:
    """float32 [T, K]: the weights `config` gives experts chosen otherwise than by their scores
    (a table of token ids: DeepSeek-V4's hash layers): each chosen expert's score, renormalised
    and scaled as route's weights are. The scoring must have per-expert scores (not
    sparsemixer); the correction bias and the groups, which only choose, play no part."""
    if router_logits_TE.dim() != 2 or router_logits_TE.shape[1] != config.num_experts:
        raise ValueError(
            f"router_logits must have shape [tokens, num_experts={config.num_experts}], "
            f"got {tuple(router_logits_TE.shape)}"
        )
    if tuple(topk_ids_TK.shape) != (router_logits_TE.shape[0], config.top_k):
        raise ValueError(
            f"topk_ids must have shape [tokens={router_logits_TE.shape[0]}, "
            f"top_k={config.top_k}], got {tuple(topk_ids_TK.shape)}"
        )
    scores_TE = scores_of(router_logits_TE.float(), config.scoring)
    return _renormalized_and_scaled(scores_TE.gather(1, topk_ids_TK.long()), config)


def _renormalized_and_scaled(weights_TK: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    """The top-k weights divided by their sum where config.renormalize (+ 1e-20 for sigmoid
    and sqrtsoftplus scores), then times the routed scaling factor."""
    if config.renormalize:
        denominator = weights_TK.sum(dim=-1, keepdim=True)
        if config.scoring in ("sigmoid", "sqrtsoftplus"):
            denominator = denominator + 1e-20
        weights_TK = weights_TK / denominator
    if config.routed_scaling_factor != 1.0:
        weights_TK = weights_TK * config.routed_scaling_factor
    return weights_TK


def _top_k_scores(
    logits_TE: torch.Tensor, config: RouterConfig, correction_bias_E: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, unnormalised weights) of softmax, sigmoid or sqrtsoftplus scoring: the top-k of
    the choice scores (the scores, or the logits, plus the bias; grouped), weighted by their
    scores."""
    scores_TE = scores_of(logits_TE, config.scoring)
    if config.use_correction_bias or config.num_groups > 1 or config.choice_on_logits:
        choice_TE = logits_TE if config.choice_on_logits else scores_TE
        if config.use_correction_bias:
            choice_TE = choice_TE + correction_bias_E.float().reshape(1, -1)
        if config.num_groups > 1:
            choice_TE = _mask_to_top_groups(choice_TE, config)
        _, topk_ids_TK = torch.topk(choice_TE, config.top_k, dim=-1)
        return topk_ids_TK, scores_TE.gather(1, topk_ids_TK)
    topk_weights_TK, topk_ids_TK = torch.topk(scores_TE, config.top_k, dim=-1)
    return topk_ids_TK, topk_weights_TK


def scores_of(logits_TE: torch.Tensor, scoring: Scoring) -> torch.Tensor:
    """float32 [T, E]: the scores of fp32 logits under softmax, sigmoid or sqrtsoftplus
    scoring (sparsemixer has none: its rounds take the logits)."""
    if scoring == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits_TE)
    if scoring == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits_TE).sqrt()
    raise ValueError(f"scoring {scoring!r} has no per-expert scores")


def _sparsemixer(logits_TE: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) of PhiMoE's sparsemixer at inference (the module docstring): two rounds,
    each the largest logit not yet taken, weighted by its softmax over the logits not yet
    taken within a relative gap of 2 eps below it."""
    ids, weights = [], []
    remaining_TE = logits_TE
    for _ in range(2):
        largest_T1, best_T1 = remaining_TE.max(dim=-1, keepdim=True)
        gap_TE = (largest_T1 - logits_TE) / logits_TE.abs().clamp(min=largest_T1)
        kept_TE = remaining_TE.masked_fill(gap_TE > 2 * eps, float("-inf"))
        weights.append(torch.softmax(kept_TE, dim=-1).gather(1, best_T1))
        ids.append(best_T1)
        remaining_TE = remaining_TE.scatter(1, best_T1, float("-inf"))
    return torch.cat(ids, dim=1), torch.cat(weights, dim=1)


def check_finite_logits(router_logits_TE: torch.Tensor) -> None:
    """Raises if the router logits hold NaN or Inf. Reads the data: a host sync."""
    if not bool(torch.isfinite(router_logits_TE).all()):
        raise ValueError("router_logits hold NaN or Inf")


def _mask_to_top_groups(choice_TE: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    tokens = choice_TE.shape[0]
    # explicit group width: -1 is ambiguous when a rank has zero tokens
    grouped_TGX = choice_TE.view(tokens, config.num_groups, config.num_experts // config.num_groups)
    if config.group_score == "max":
        group_scores_TG = grouped_TGX.amax(dim=-1)
    else:
        group_scores_TG = grouped_TGX.topk(2, dim=-1).values.sum(dim=-1)
    kept_groups_TG = group_scores_TG.topk(config.top_groups, dim=-1).indices
    # the dropped groups' mask built directly and broadcast over each group's experts: no
    # negation and no expanded copy (two launches fewer than masking with ~keep_TE)
    dropped_TG = torch.ones_like(group_scores_TG, dtype=torch.bool).scatter_(
        1, kept_groups_TG, False
    )
    return grouped_TGX.masked_fill(dropped_TG.unsqueeze(-1), config.dropped_group_score).view(
        choice_TE.shape
    )
