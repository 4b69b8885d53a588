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
  Experts of the groups not kept get the choice score `dropped_group_score`: -inf (never chosen,
  as DeepSeek's reference and current transformers do) or 0.0 (transformers before its 2026 fix,
  which picks them over kept experts whose biased scores are negative).
- grouped top-k with `group_score="max"` (DeepSeek-V2's group-limited greedy): a group is scored by
  its best expert instead of its two best; any scoring.
- `choice_on_logits` (Kolibri): the experts are chosen on the logits plus the correction bias
  rather than on the scores plus it; the weights are the scores, as above. Without a bias the
  two choices are the same (both scorings keep the logits' order).

Non-finite logits are not checked on the hot path (that would need a host sync): a token whose
logits hold NaN gets NaN weights, so its output row is NaN and no other token is affected. Pass
`check_finite=True` to raise instead (a host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Scoring = Literal["softmax", "sigmoid"]
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

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}"
            )
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
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
    if config.scoring == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    else:
        scores_TE = torch.sigmoid(logits_TE)
    if config.use_correction_bias or config.num_groups > 1 or config.choice_on_logits:
        choice_TE = logits_TE if config.choice_on_logits else scores_TE
        if config.use_correction_bias:
            choice_TE = choice_TE + correction_bias_E.float().reshape(1, -1)
        if config.num_groups > 1:
            choice_TE = _mask_to_top_groups(choice_TE, config)
        _, topk_ids_TK = torch.topk(choice_TE, config.top_k, dim=-1)
        topk_weights_TK = scores_TE.gather(1, topk_ids_TK)
    else:
        topk_weights_TK, topk_ids_TK = torch.topk(scores_TE, config.top_k, dim=-1)
    if config.renormalize:
        denominator = topk_weights_TK.sum(dim=-1, keepdim=True)
        if config.scoring == "sigmoid":
            denominator = denominator + 1e-20
        topk_weights_TK = topk_weights_TK / denominator
    if config.routed_scaling_factor != 1.0:
        topk_weights_TK = topk_weights_TK * config.routed_scaling_factor
    return topk_ids_TK.to(torch.int32), topk_weights_TK


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
