"""Llama, Qwen2 and Qwen3 as one family: Qwen2 adds a qkv bias, Qwen3 per-head q/k RMSNorm."""

from collections.abc import Iterable

import torch
from torch import nn

from ascendserve.layers.activation import GatedActivation
from ascendserve.layers.attention import AttentionMetadata, paged_attention
from ascendserve.layers.norm import RMSNorm
from ascendserve.layers.rotary import RotaryEmbedding, position_limit, rope_inv_freq
from ascendserve.models.llama_cpu_decode import CpuDecodeLoop
from ascendserve.models.weights import StackedLoader


def head_dim_of(config) -> int:
    """config.head_dim when set, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Self-attention with a fused qkv projection over the paged KV cache."""

    def __init__(self, config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size,
                                bias=getattr(config, "attention_bias", False))
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.scale = self.head_dim ** -0.5

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused."""

    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = GatedActivation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the caller adds the two (the next
        layer's input norm or the final norm does, in one op with its norm)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config, head_dim_of(config))
        rotary = RotaryEmbedding(inv_freq, scaling, position_limit(config) or config.max_position_embeddings)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = rotary
        # the one-op decode of llama_cpu_decode.py (or None) and the modules it was built from
        self._cpu_decode: tuple[tuple, CpuDecodeLoop | None] = ((), None)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if (loop := self._cpu_decode_loop()) is not None and loop.runs(hidden, positions, kv_caches, meta):
            return loop(hidden, positions, kv_caches, meta)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        return self.norm(hidden, residual)[0] if residual is not None else self.norm(hidden)

    def _cpu_decode_loop(self) -> CpuDecodeLoop | None:
        """The one-op decode on the bf16 CPU kernels, built on first use (after prepacking) and again when the layers
        it read were replaced; None where the layers do not all run on those kernels."""
        source = CpuDecodeLoop.source_of(self)
        if self._cpu_decode[0] != source:
            self._cpu_decode = (source, CpuDecodeLoop.build(self))
        return self._cpu_decode[1]


class LlamaForCausalLM(nn.Module):
    """The causal LM head over LlamaModel; also serves Qwen2ForCausalLM and Qwen3ForCausalLM."""

    # compute_logits is lm_head(hidden) and nothing more: greedy rows may take the lm_head's fused argmax instead
    # (ModelRunner._fused_greedy); a subclass that scales or masks the logits sets this False.
    greedy_from_lm_head = True

    # checkpoint name piece -> (fused parameter name piece, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def kv_cache_spec(self) -> dict:
        """Shape of the paged KV cache this model needs: one per attention layer."""
        attn = self.model.layers[0].self_attn
        return {"num_layers": len(self.model.layers), "num_kv_heads": attn.num_kv_heads,
                "head_dim": attn.head_dim}

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """Hidden states [T, hidden] of the packed tokens."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits for the rows that sample."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the fused parameters; returns the names loaded."""
        loader = StackedLoader(self, self.packed_modules, self._shard_sizes)
        skip = ("rotary_emb.inv_freq",)
        if getattr(self.config, "tie_word_embeddings", False):
            skip += ("lm_head.weight",)
        return loader.load(weights, skip=skip)

    def _shard_sizes(self, fused_name: str, module: nn.Module) -> list[int]:
        if fused_name == "qkv_proj":
            attn = self.model.layers[0].self_attn
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [self.config.intermediate_size] * 2
