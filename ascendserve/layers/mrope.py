"""Multimodal RoPE (Qwen3.5): partial rotary whose frequency slots take positions from 3 axes (T, H, W)."""

import torch

from ascendserve.layers import cpu_kernels
from ascendserve.layers.rotary import RotaryTables, rotate_half


def interleaved_axis_of_slots(num_slots: int, mrope_section: list[int]) -> torch.Tensor:
    """Which axis (0=T, 1=H, 2=W) each frequency slot reads its position from, interleaved.

    Slot i belongs to H when i % 3 == 1 and i < 3 * section[1], to W when i % 3 == 2 and
    i < 3 * section[2], else to T. Example, 32 slots, section [11, 11, 10]: THWTHW...THWTH
    (slot 30 is T, slot 31 is H), as transformers' Qwen3.5 `recomposition_frequencies`.
    """
    axis = torch.zeros(num_slots, dtype=torch.long)
    for dim in (1, 2):
        axis[dim:mrope_section[dim] * 3:3] = dim
    return axis


class MRotaryEmbedding(RotaryTables):
    """Neox-style RoPE over the first `rotary_dim` channels, positions [3, T] (one row per axis).

    Text tokens carry the same position on all three rows, which reduces to plain 1-D RoPE; image
    tokens (later) get distinct (t, h, w) rows.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_position: int,
                 mrope_section: list[int]) -> None:
        super().__init__(inv_freq, attention_scaling, max_position, duplicate=False)
        axis = interleaved_axis_of_slots(inv_freq.numel(), mrope_section)
        self.register_buffer("axis_of_slot", axis, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotate q [T, Hq, D] and k [T, Hk, D]; positions [3, T] (or [T] for text only)."""
        if positions.ndim == 1:  # text only: every axis has the token's position, so each slot reads that row
            cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        else:
            cos, sin = self._select(self.cos_cache, positions), self._select(self.sin_cache, positions)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # [T, rotary_dim] fp32
        if (kernels := self._cpu_op(q, k, cos)) is not None:
            # RotaryEmbedding's op (csrc/rope_cpu.cpp) with these per-token rows as its cos / sin tables, token t
            # reading row t: one pass per tensor (fp32 arithmetic, bf16 rounded once) for the torch form's ~20 ops
            rows = torch.arange(cos.shape[0])
            return kernels.rope_neox(q, rows, cos, sin), kernels.rope_neox(k, rows, cos, sin)
        cos, sin = cos.to(q.dtype)[:, None, :], sin.to(q.dtype)[:, None, :]
        return _apply(q, cos, sin, self.rotary_dim), _apply(k, cos, sin, self.rotary_dim)

    def _cpu_op(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor):
        """The CPU op namespace for fp32 or bf16 [T, H, D] q and k (contiguous last dimension) with fp32 tables,
        outside a compiled forward; else None."""
        if q.dim() == k.dim() == 3 and q.stride(-1) == k.stride(-1) == 1 and q.dtype == k.dtype:
            return cpu_kernels.float_ops(q, k, cos)
        return None

    def _select(self, cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T, rotary_dim / 2]: slot i of token t is cache[positions[axis_of_slot[i], t], i]."""
        per_axis = cache[positions]  # [3, T, slots]
        index = self.axis_of_slot[None, None, :].expand(1, *per_axis.shape[1:])
        return per_axis.gather(0, index)[0]


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
