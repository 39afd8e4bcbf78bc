"""DeepSeek-style MoE routing: softmax or sigmoid scores, group-limited top-k, scaling.

Exactly as transformers 5 defines the routers (the oracle):

    DeepSeek-V2 (`DeepseekV2TopkRouter`, scoring "softmax"):
        s = softmax(logits);  topk_method "greedy": top-k of s;
        "group_limited_greedy": experts in n_group groups, keep the topk_group groups of largest
        max(s), top-k of s inside them;  weights = s[top-k] * routed_scaling_factor
        (NOTE(router): HF's V2 router never renormalises, whatever `norm_topk_prob` says.)
    DeepSeek-V3 / GLM-4 MoE (`DeepseekV3TopkRouter`, topk_method "noaux_tc", scoring "sigmoid"):
        s = sigmoid(logits); c = s + e_score_correction_bias (for the choice only);
        group score = sum of the top 2 c of the group; keep topk_group groups; ids = top-k of c
        inside them; weights = s[ids], / (sum + 1e-20) if norm_topk_prob,
        * routed_scaling_factor.

(DeepSeek-V2 paper, arXiv:2405.04434 sec. 2.2 "device-limited routing"; DeepSeek-V3 report,
arXiv:2412.19437 sec. 2.1.2 "auxiliary-loss-free load balancing".) The expert computation
itself is `FusedMoE.forward_routed`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOPK_METHODS = {"softmax": ("greedy", "group_limited_greedy"), "sigmoid": ("noaux_tc",)}


@dataclass(frozen=True)
class DeepseekRouting:
    """A DeepSeek router's settings (validated).

    Attributes:
        num_experts, top_k: routed experts and experts per token.
        scoring_func: "softmax" (V2) or "sigmoid" (V3, GLM-4 MoE).
        topk_method: "greedy" or "group_limited_greedy" (softmax), "noaux_tc" (sigmoid).
        n_group, topk_group: expert groups and groups kept (group-limited methods).
        norm_topk_prob: renormalise the k weights (sigmoid scoring only, as HF).
        routed_scaling_factor: multiplies the weights.

    Raises (construction):
        ValueError: naming the field: an unknown scoring_func or topk_method (or one of the
            other scoring's), top_k outside [1, num_experts], groups that do not divide the
            experts, topk_group outside [1, n_group], or groups with fewer than 2 experts for
            noaux_tc (its group score sums the top 2).
    """

    num_experts: int
    top_k: int
    scoring_func: str
    topk_method: str
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring_func not in TOPK_METHODS:
            raise ValueError(f"unsupported scoring_func {self.scoring_func!r}; supported: "
                             f"{sorted(TOPK_METHODS)}")
        if self.topk_method not in TOPK_METHODS[self.scoring_func]:
            raise ValueError(f"unsupported topk_method {self.topk_method!r} for scoring_func "
                             f"{self.scoring_func!r}; supported: "
                             f"{list(TOPK_METHODS[self.scoring_func])}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be between 1 and the "
                             f"{self.num_experts} routed experts")
        if self.topk_method != "greedy":
            if not self.n_group or self.num_experts % self.n_group:
                raise ValueError(f"n_group {self.n_group} must divide the {self.num_experts} "
                                 f"routed experts (topk_method {self.topk_method!r})")
            if not self.topk_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group {self.topk_group} must be between 1 and n_group "
                                 f"{self.n_group}")
            if self.topk_method == "noaux_tc" and self.num_experts // self.n_group < 2:
                raise ValueError(f"n_group {self.n_group} leaves fewer than 2 experts per group "
                                 f"(noaux_tc scores a group by its top 2)")

    def select_experts(self, router_logits: torch.Tensor,
                       e_score_correction_bias: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route tokens.

        Args:
            router_logits: [n, num_experts] float32.
            e_score_correction_bias: [num_experts] float32 (sigmoid scoring; None = zeros).

        Returns:
            (topk_weights [n, top_k] float32, topk_ids [n, top_k] int64), in no set order.
        """
        logits = router_logits.float()
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
            choice = scores
        else:
            scores = logits.sigmoid()
            choice = (scores if e_score_correction_bias is None
                      else scores + e_score_correction_bias.float())
        if self.topk_method != "greedy":
            n = choice.shape[0]
            grouped = choice.view(n, self.n_group, -1)
            group_scores = (grouped.max(dim=-1).values if self.topk_method != "noaux_tc"
                            else grouped.topk(2, dim=-1)[0].sum(dim=-1))
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
            keep = group_mask[:, :, None].expand_as(grouped).reshape(n, -1)
            fill = 0.0 if self.scoring_func == "softmax" else float("-inf")
            choice = choice.masked_fill(~keep, fill)
        if self.scoring_func == "softmax":
            topk_weights, topk_ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)
        else:
            topk_ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            topk_weights = scores.gather(1, topk_ids)
            if self.norm_topk_prob:
                topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_weights * self.routed_scaling_factor, topk_ids
