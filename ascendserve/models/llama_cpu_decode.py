"""A bf16 Llama-family decode step on the CPU kernels as one flat loop of op calls.

The module path runs the same kernels, but a decode step of the demo (30 layers) makes ~13 Python calls a layer
around its 8 ops (nn.Module dispatch, each layer's dtype and shape checks, q / k / v views), and those calls run
with the interpreter's data pushed out of cache by the kernels between them. This loop checks the model once and
each step once, then calls the ops directly: the same ops on the same tensors in the same order, so the same bits
(tests/models/test_llama_parity.py). 2-core Xeon with AMX, the demo at 64 streams of 256 + 128 tokens, decode steps
alternated in one process (median of 63-64): 66.2 ms by the modules, 59.8 ms by this loop.
"""

import torch
from torch import nn

from ascendserve.layers import cpu_kernels
from ascendserve.layers.compact_linear import Bf16GateUpSilu, Bf16Linear
from ascendserve.layers.norm import RMSNorm
from ascendserve.layers.rotary import RotaryEmbedding


class CpuDecodeLoop:
    """Each layer's kernel arguments, read from a LlamaModel whose layers all run on the bf16 CPU kernels."""

    def __init__(self, model: nn.Module, kernels) -> None:
        self.kernels = kernels
        self.rotary = model.rotary
        self.final_norm = model.norm
        self.layers = [_layer_args(layer) for layer in model.layers]

    @classmethod
    def build(cls, model: nn.Module) -> "CpuDecodeLoop | None":
        """The loop for `model`, or None where any of its layers would not run the kernels this loop calls: bf16
        linears with bf16 outputs (Bf16Linear.for_bf16), the gate-and-up with its SiLU (Bf16GateUpSilu), plain
        RMSNorms, neox rotary on fp32 tables, nothing compiled (compilation.py), and a decode kernel that takes bf16
        queries for this head_dim."""
        if not (len(model.layers) and all(_runs_on_kernels(layer) for layer in model.layers)
                and type(model.norm) is RMSNorm and isinstance(model.rotary, RotaryEmbedding)
                and model.rotary.cos_cache.dtype == torch.float32 and model.norm.weight.device.type == "cpu"
                and not any("forward" in vars(m) for m in model.modules())):  # compiled modules take the torch forms
            return None
        kernels = cpu_kernels.ops()
        if kernels is None or not kernels.paged_decode_bf16_dot(model.layers[0].self_attn.head_dim):
            return None  # no kernels; or the module path widens the queries to fp32
        return cls(model, kernels)

    @staticmethod
    def source_of(model: nn.Module) -> tuple:
        """The modules a loop reads that prepacking replaces (all at once, at load): a loop, or a None, built from
        other ones is stale."""
        return (model.layers[0].self_attn.qkv_proj, model.layers[-1].mlp.down_proj) if len(model.layers) else ()

    def runs(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> bool:
        """Whether this step is one the loop computes as the modules would: every row a decode (no prefill), bf16
        hidden states on the CPU over bf16 caches, int64 positions, outside a compiled forward."""
        return (meta.decode_token_idx is not None and not meta.prefills and hidden.dtype == torch.bfloat16
                and hidden.device.type == "cpu" and hidden.dim() == 2 and hidden.is_contiguous()
                and positions.dtype == torch.long and positions.dim() == 1 and positions.is_contiguous()
                and all(kv.dtype == torch.bfloat16 and kv.device.type == "cpu" for kv in kv_caches)
                and not torch.compiler.is_compiling())

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        """The final norm's output for the embedded tokens `hidden` [T, hidden] (LlamaModel.forward's result)."""
        ops, rows = self.kernels, hidden.shape[0]
        cos, sin = self.rotary.cos_cache, self.rotary.sin_cache
        slots, tables, lens = meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens
        residual = None
        for args, kv_cache in zip(self.layers, kv_caches):
            (norm_in, eps_in, qkv, sizes, heads, kv_heads, qk_norms, scale, o_proj, norm_post, eps_post, gate_up,
             down) = args
            if residual is None:
                residual, hidden = hidden, ops.rms_norm(hidden, norm_in, eps_in, False)
            else:
                hidden, residual = ops.add_rms_norm(hidden, residual, norm_in, eps_in, False)
            q, k, v = _linear(ops, hidden, qkv).split(sizes, dim=-1)
            q, k, v = q.view(rows, heads, -1), k.view(rows, kv_heads, -1), v.view(rows, kv_heads, -1)
            if qk_norms is not None:
                (q_w, q_eps), (k_w, k_eps) = qk_norms
                q, k = ops.rms_norm(q, q_w, q_eps, False), ops.rms_norm(k, k_w, k_eps, False)
            q, k = ops.rope_neox(q, positions, cos, sin), ops.rope_neox(k, positions, cos, sin)
            out = ops.paged_decode_write(q, k, v, kv_cache, slots, tables, lens, scale)
            hidden = _linear(ops, out.view(rows, -1), o_proj)
            hidden, residual = ops.add_rms_norm(hidden, residual, norm_post, eps_post, False)
            hidden = _linear(ops, ops.bf16_linear_silu_mul(hidden, gate_up.packed, gate_up.out_features), down)
        norm = self.final_norm
        if residual is None:
            return ops.rms_norm(hidden, norm.weight, norm.eps, False)
        return ops.add_rms_norm(hidden, residual, norm.weight, norm.eps, False)[0]


def _linear(ops, x: torch.Tensor, layer: Bf16Linear) -> torch.Tensor:
    """Bf16Linear._kernel's call for a bf16-in, bf16-out layer."""
    bias = layer.bias_fp32 if layer.bias is not None else None
    return ops.bf16_linear_bf16x(x, layer.packed, layer.out_features, bias, True)


def _bf16_out(layer: nn.Module) -> bool:
    return type(layer) is Bf16Linear and layer.bf16_io and not layer.fp32_out


def _runs_on_kernels(layer: nn.Module) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attn.qk_norm:
        norms += [attn.q_norm, attn.k_norm]
    return (_bf16_out(attn.qkv_proj) and _bf16_out(attn.o_proj) and _bf16_out(mlp.down_proj)
            and type(mlp.gate_up_proj) is Bf16GateUpSilu and isinstance(mlp.act, nn.Identity)
            and all(type(n) is RMSNorm and n.weight.dtype in (torch.bfloat16, torch.float32) for n in norms))


def _layer_args(layer: nn.Module) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    qk_norms = ((attn.q_norm.weight, attn.q_norm.eps), (attn.k_norm.weight, attn.k_norm.eps)) if attn.qk_norm else None
    return (layer.input_layernorm.weight, layer.input_layernorm.eps, attn.qkv_proj,
            [attn.q_size, attn.kv_size, attn.kv_size], attn.num_heads, attn.num_kv_heads, qk_norms, attn.scale,
            attn.o_proj, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, mlp.gate_up_proj,
            mlp.down_proj)
