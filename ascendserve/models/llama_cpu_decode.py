"""A bf16 Llama-family decode step on the CPU kernels in one op call (csrc/llama_decode_cpu.cpp).

The module path runs the same kernels, but a decode step of the demo (30 layers) makes ~13 Python calls a layer
around its 8 ops (nn.Module dispatch, each layer's dtype and shape checks, q / k / v views), and those calls run
with the interpreter's data pushed out of cache by the kernels between them (perf, 64 streams: ~6% of both cores
in the interpreter, ~17% in libgomp, the other core waiting meanwhile). This loop checks the model once and each
step once, then hands every layer to one op that calls the same registered ops in the same order from C++: the same
bits (tests/models/test_llama_parity.py). 2-core Xeon with AMX, the demo at 64 streams of 256 + 128 tokens, median
decode step of 127 (one process each, alternated): 65.6-67.4 ms by the modules, 55.3-58.3 ms by this op (a flat
Python loop of the same op calls: 64.7-67.4 against 70.2-73.4 in an earlier hour).
"""

import torch
from torch import nn

from ascendserve.compilation import is_compiled
from ascendserve.layers import cpu_kernels
from ascendserve.layers.compact_linear import Bf16GateUpSilu, Bf16Linear
from ascendserve.layers.norm import RMSNorm
from ascendserve.layers.rotary import RotaryEmbedding


class CpuDecodeLoop:
    """The op's arguments (every layer's weights, the shape they share), read from a LlamaModel whose layers all run on
    the bf16 CPU kernels."""

    def __init__(self, model: nn.Module, kernels) -> None:
        self.kernels = kernels
        self.rotary = model.rotary
        attn = model.layers[0].self_attn
        has_bias = attn.qkv_proj.bias is not None
        self.weights = [w for layer in model.layers for w in _layer_weights(layer, has_bias)] + [model.norm.weight]
        self.dims = [attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.qkv_proj.out_features,
                     attn.o_proj.out_features, model.layers[0].mlp.gate_up_proj.out_features,
                     model.layers[0].mlp.down_proj.out_features, int(has_bias), int(attn.qk_norm)]
        self.eps, self.scale = model.norm.eps, attn.scale

    @classmethod
    def build(cls, model: nn.Module) -> "CpuDecodeLoop | None":
        """The loop for `model`, or None where any of its layers would not run the kernels this loop calls: bf16
        linears with bf16 outputs (Bf16Linear.for_bf16), the gate-and-up with its SiLU (Bf16GateUpSilu), plain
        RMSNorms, neox rotary on fp32 tables, nothing compiled (compilation.py), and a decode kernel that takes bf16
        queries for this head_dim."""
        if not (len(model.layers) and all(_runs_on_kernels(layer) for layer in model.layers)
                and type(model.norm) is RMSNorm and _alike(model) and isinstance(model.rotary, RotaryEmbedding)
                and model.rotary.cos_cache.dtype == torch.float32 and model.norm.weight.device.type == "cpu"
                and not any(is_compiled(m) for m in model.modules())):  # compiled modules take the torch forms
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
        return self.kernels.llama_decode_layers(
            hidden, positions, self.weights, list(kv_caches), meta.slot_mapping, meta.decode_block_tables,
            meta.decode_context_lens, self.rotary.cos_cache, self.rotary.sin_cache, self.dims, self.eps, self.scale)


def _bf16_out(layer: nn.Module) -> bool:
    return type(layer) is Bf16Linear and layer.bf16_io and not layer.fp32_out


def _norms(layer: nn.Module) -> list[nn.Module]:
    """The layer's RMSNorms: input, post-attention, and Qwen3's per-head q / k norms."""
    attn = layer.self_attn
    head_norms = [attn.q_norm, attn.k_norm] if attn.qk_norm else []
    return [layer.input_layernorm, layer.post_attention_layernorm, *head_norms]


def _runs_on_kernels(layer: nn.Module) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    return (_bf16_out(attn.qkv_proj) and _bf16_out(attn.o_proj) and attn.o_proj.bias is None
            and _bf16_out(mlp.down_proj) and mlp.down_proj.bias is None
            and type(mlp.gate_up_proj) is Bf16GateUpSilu and isinstance(mlp.act, nn.Identity)
            and all(type(n) is RMSNorm and n.weight.dtype in (torch.bfloat16, torch.float32) for n in _norms(layer)))


def _alike(model: nn.Module) -> bool:
    """Every layer of the op's one shape (the first layer's head counts, widths, bias, q / k norms and rotary) and one
    eps for every norm."""

    def shape(layer) -> tuple:
        attn, mlp = layer.self_attn, layer.mlp
        return (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.qkv_proj.out_features, attn.o_proj.out_features,
                mlp.gate_up_proj.out_features, mlp.down_proj.out_features, attn.qkv_proj.bias is not None,
                attn.qk_norm, attn.scale, attn.rotary)

    first = shape(model.layers[0])
    eps = {model.norm.eps} | {n.eps for layer in model.layers for n in _norms(layer)}
    return (all(shape(layer) == first for layer in model.layers) and model.layers[0].self_attn.rotary is model.rotary
            and len(eps) == 1)


def _layer_weights(layer: nn.Module, has_bias: bool) -> list[torch.Tensor]:
    """The op's per-layer weights, in its order (csrc/llama_decode_cpu.cpp)."""
    attn, mlp = layer.self_attn, layer.mlp
    weights = [layer.input_layernorm.weight, attn.qkv_proj.packed] + ([attn.qkv_proj.bias_fp32] if has_bias else [])
    weights += [attn.o_proj.packed, layer.post_attention_layernorm.weight, mlp.gate_up_proj.packed,
                mlp.down_proj.packed]
    return weights + ([attn.q_norm.weight, attn.k_norm.weight] if attn.qk_norm else [])
