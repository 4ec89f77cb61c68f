"""Per-expert checkpoint tensors fused into the MoE layout, and the error that names what is missing."""

import pytest
import torch

from ascendserve.layers.moe import fuse_expert_weights
from ascendserve.models.weights import WeightLoadError


def per_expert(layer: int, num_experts: int, skip: tuple[int, str] | None = None):
    for e in range(num_experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if (e, proj) != skip:
                yield f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", torch.full((2, 3), float(e))


def test_groups_fuse_and_a_missing_expert_is_named():
    fused = dict(fuse_expert_weights([*per_expert(0, 4), ("model.norm.weight", torch.ones(3))], 4))
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 4, 3)
    assert fused["model.layers.0.mlp.experts.down_proj"][:, 0, 0].tolist() == [0, 1, 2, 3]
    assert "model.norm.weight" in fused
    # layer 1 lacks expert 2's up_proj: that group is named with the expert, not layer 1's complete gate_proj
    with pytest.raises(WeightLoadError, match=r"layers\.1\.mlp\.experts\.\*\.up_proj: experts \[2\] missing$"):
        list(fuse_expert_weights([*per_expert(0, 4), *per_expert(1, 4, skip=(2, "up_proj"))], 4))
