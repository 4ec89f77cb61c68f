"""Mixture of experts: softmax top-k routing and experts stored as 3-D tensors, in plain torch."""

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ascendserve.layers.activation import GatedActivation
from ascendserve.models.weights import WeightLoadError


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool = True):
    """(weights [T, k] in the logits' dtype, expert ids [T, k]) from a fp32 softmax over experts."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class FusedMoE(nn.Module):
    """The routed experts: `gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I].

    The parameter names and shapes are those of the fused checkpoint layout
    (`mlp.experts.gate_up_proj`, no `.weight`); `fuse_expert_weights` turns the per-expert layout
    into it. Expert e computes down_e(act(gate_e x) * up_e x).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = GatedActivation(hidden_act)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights / topk_ids [T, k] -> sum over k of weight * expert(x), [T, H]."""
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.flatten()
        order = flat_ids.argsort(stable=True)  # (token, k) pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        sorted_x = x[order // top_k]
        sorted_out = torch.empty_like(sorted_x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                h = self.act(nn.functional.linear(sorted_x[start:start + count], self.gate_up_proj[expert]))
                sorted_out[start:start + count] = nn.functional.linear(h, self.down_proj[expert])
                start += count
        per_pair = torch.empty_like(sorted_out)
        per_pair[order] = sorted_out  # back to (token, k) order
        weights = topk_weights.to(x.dtype).unsqueeze(-1)
        return (per_pair.view(num_tokens, top_k, -1) * weights).sum(dim=1)


_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_weights(weights: Iterable[tuple[str, torch.Tensor]],
                        num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, stacking per-expert ones into the fused layout.

    `<p>.experts.{e}.gate_proj.weight` and `.up_proj.weight` for all e become one
    `<p>.experts.gate_up_proj` [E, 2I, H]; `.down_proj.weight` becomes `<p>.experts.down_proj`
    [E, H, I]. A group is yielded as soon as it is complete, so at most one layer's experts are
    held at a time in a checkpoint stored layer by layer. Incomplete groups raise WeightLoadError.
    """
    pending: dict[tuple[str, str], dict[int, torch.Tensor]] = defaultdict(dict)
    for name, tensor in weights:
        match = _PER_EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, proj, expert = match["prefix"], match["proj"], int(match["expert"])
        pending[(prefix, proj)][expert] = tensor
        fused = _complete_group(pending, prefix, num_experts)
        if fused is not None:
            yield fused
    if pending:  # the groups short of experts (a complete gate_proj waits for its up_proj, and is not named)
        short = [f"{prefix}.*.{proj}: experts {sorted(set(range(num_experts)) - set(have))} missing"
                 for (prefix, proj), have in pending.items() if len(have) < num_experts]
        raise WeightLoadError(f"checkpoint lacks per-expert tensors of {num_experts} experts: {'; '.join(short)}")


def _complete_group(pending, prefix: str, num_experts: int) -> tuple[str, torch.Tensor] | None:
    """Pop and stack one finished group of `prefix`, if any."""
    if len(pending.get((prefix, "down_proj"), ())) == num_experts:
        down = pending.pop((prefix, "down_proj"))
        return f"{prefix}.down_proj", torch.stack([down[e] for e in range(num_experts)])
    gate, up = pending.get((prefix, "gate_proj"), {}), pending.get((prefix, "up_proj"), {})
    if len(gate) == num_experts and len(up) == num_experts:
        del pending[(prefix, "gate_proj")], pending[(prefix, "up_proj")]
        stacked = [torch.cat([gate[e], up[e]], dim=0) for e in range(num_experts)]
        return f"{prefix}.gate_up_proj", torch.stack(stacked)
    return None
