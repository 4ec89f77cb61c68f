"""Rotary position embedding with the inverse frequencies transformers computes for each rope type."""

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ascendserve.layers import cpu_kernels

# Rope types whose frequencies do not depend on the running sequence length.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "proportional"}


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """1 / base^(2i/dim) for i < dim/2, as the original RoPE."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def rope_inv_freq(config, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) for `config.rope_parameters`, via transformers' own functions."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported yet; supported: {sorted(STATIC_ROPE_TYPES)}")
    if rope_type == "default":
        return default_inv_freq(params.get("rope_theta", 10000.0), rotary_dim), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config)


# Config fields that bound the sequence length (vLLM's list): the smallest one present counts.
_LENGTH_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                  "max_sequence_length", "max_seq_length", "seq_len")


def position_limit(config) -> int | None:
    """The longest sequence the model's positions cover, as vLLM derives it: the smallest length field, times the rope
    scaling factor (yarn: its original_max_position_embeddings times the factor; llama3 / longrope: unchanged). None
    without a length field. Qwen3.5 with the model card's YaRN (factor 4 over 262144): 1048576."""
    lengths = [value for name in _LENGTH_FIELDS if isinstance(value := getattr(config, name, None), int) and value > 0]
    if not lengths:
        return None
    limit = min(lengths)
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("su", "longrope", "llama3"):
        if rope_type == "yarn" and params.get("original_max_position_embeddings"):
            limit = params["original_max_position_embeddings"]
        limit = int(limit * (params.get("factor") or 1.0))
    return limit


class RotaryTables(nn.Module):
    """cos / sin tables [positions, slots] of every position's angles (fp32, times the attention scaling), shared by
    the rotary embeddings; `duplicate` repeats the slots (neox's rotate-half layout)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_position: int, duplicate: bool) -> None:
        super().__init__()
        self.rotary_dim = inv_freq.numel() * 2
        self.inv_freq, self.attention_scaling, self.duplicate = inv_freq, attention_scaling, duplicate
        cos, sin = self._tables(max_position)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def cover(self, num_positions: int) -> None:
        """Grow the tables to at least `num_positions` positions."""
        if num_positions > self.cos_cache.shape[0]:
            cos, sin = self._tables(num_positions)
            self.cos_cache, self.sin_cache = cos.to(self.cos_cache.device), sin.to(self.sin_cache.device)

    def _tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(num_positions, dtype=torch.float)[:, None] * self.inv_freq[None, :]
        if self.duplicate:
            freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling


def cover_positions(model: nn.Module, num_positions: int) -> None:
    """Grow every rotary table of `model` to `num_positions` rows (a max_model_len beyond the config's own limit, as
    VLLM_ALLOW_LONG_MAX_MODEL_LEN allows)."""
    for module in model.modules():
        if isinstance(module, RotaryTables):
            module.cover(num_positions)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(RotaryTables):
    """Neox-style (rotate-half) RoPE over the first `rotary_dim` channels of each head."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_position: int) -> None:
        super().__init__(inv_freq, attention_scaling, max_position, duplicate=True)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotate q [T, Hq, D] and k [T, Hk, D] by their token positions [T]."""
        if (kernels := self._cpu_op(positions, q, k)) is not None:  # one pass each (csrc/rope_cpu.cpp)
            return (kernels.rope_neox(q, positions, self.cos_cache, self.sin_cache),
                    kernels.rope_neox(k, positions, self.cos_cache, self.sin_cache))
        cos = self.cos_cache[positions].to(q.dtype)[:, None, :]
        sin = self.sin_cache[positions].to(q.dtype)[:, None, :]
        return _apply(q, cos, sin, self.rotary_dim), _apply(k, cos, sin, self.rotary_dim)

    def _cpu_op(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """The CPU op namespace for fp32 or bf16 [T, H, D] q and k with int64 positions outside a compiled forward,
        else None."""
        if (q.dim() == k.dim() == 3 and q.stride(-1) == k.stride(-1) == 1 and positions.device.type == "cpu"
                and positions.dtype == torch.long and positions.dim() == 1 and positions.is_contiguous()
                and q.dtype == k.dtype and self.cos_cache.dtype == torch.float32):
            return cpu_kernels.float_ops(q, k, self.cos_cache)
        return None


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
