"""Qwen3.5-MoE: the Qwen3.5 hybrid model with a routed-experts MLP plus a gated shared expert in every layer."""

from collections.abc import Iterator

import torch
from torch import nn

from ascendserve.layers.moe import FusedMoE, fuse_expert_weights, softmax_topk
from ascendserve.models.qwen3_5 import GatedMLP, Qwen3_5ForCausalLM


class Qwen3_5SparseMoeBlock(nn.Module):
    """sum_topk w_e * expert_e(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x).

    Router: softmax over all experts in fp32, top-k, weights renormalized to sum to 1 (Qwen3.5
    always renormalizes; its configs' `norm_topk_prob` is not read).
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                config.hidden_act)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x), self.top_k)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, weights, ids) + shared


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE text model; also serves Qwen3_5MoeForConditionalGeneration's text path.

    Loads experts stored fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
    [E, H, I], the BF16 releases) or per expert (`mlp.experts.{e}.gate_proj.weight`, ...).
    """

    # the experts' token counts are read on the host to slice each expert's rows: no captured decode graphs
    decode_graph_safe = False

    @staticmethod
    def make_mlp(config) -> nn.Module:
        return Qwen3_5SparseMoeBlock(config)

    def preprocess_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return fuse_expert_weights(weights, self.text_config.num_experts)
