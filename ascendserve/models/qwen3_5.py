"""Qwen3.5 text model: Gated DeltaNet layers with a few gated full-attention layers between them.

Layer i is `linear_attention` (Gated DeltaNet, a fixed-size recurrent state per request) or
`full_attention` (paged KV cache), from `config.layer_types`; released checkpoints repeat
[lin, lin, lin, full]. Every RMSNorm is the zero-centred (1 + w) one except the gated norm inside
Gated DeltaNet. Composite checkpoints (`*ForConditionalGeneration`) run their text path; the vision
tower and the MTP head are not loaded.
"""

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ascendserve.layers import cpu_kernels, triton_kernels
from ascendserve.layers.activation import GatedActivation
from ascendserve.layers.attention import AttentionMetadata, paged_attention
from ascendserve.layers.gated_deltanet import (causal_conv1d_decode, causal_conv1d_prefill,
                                               chunk_gated_delta_rule, recurrent_gated_delta_rule)
from ascendserve.layers.mrope import MRotaryEmbedding
from ascendserve.layers.norm import GemmaRMSNorm
from ascendserve.layers.rotary import position_limit, rope_inv_freq
from ascendserve.logger import init_logger
from ascendserve.models.weights import StackedLoader

logger = init_logger(__name__)

# Checkpoint prefixes the text model does not use: the vision tower and the multi-token-prediction head.
UNUSED_PREFIXES = ("model.visual.", "visual.", "mtp.")  # the vision tower (both layouts) and the MTP head


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into `gate_up_proj`."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = GatedActivation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class RMSNormGated(nn.Module):
    """norm(x) * w * silu(gate) with a plain weight, per value head (transformers' Qwen3_5RMSNormGated)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class Qwen3_5Attention(nn.Module):
    """Full attention with per-head q/k norms, partial MRoPE and a sigmoid output gate.

    `q_proj` rows interleave query and gate per head: [q_0, gate_0, q_1, gate_1, ...], each
    head_dim long; they are fused with k_proj and v_proj into `qkv_proj`.
    """

    def __init__(self, config, rotary: MRotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.scale = self.head_dim ** -0.5

    def shard_sizes(self) -> list[int]:
        """Rows of q_proj (query and gate), k_proj and v_proj inside `qkv_proj`."""
        return [2 * self.q_size, self.kv_size, self.kv_size]

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q_gate, k, v = self.qkv_proj(hidden).split(self.shard_sizes(), dim=-1)
        q, gate = q_gate.view(-1, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v.view(-1, self.num_kv_heads, self.head_dim), kv_cache, meta, self.scale)
        out = out.reshape(-1, self.q_size) * torch.sigmoid(gate.reshape(-1, self.q_size))
        return self.o_proj(out)


class Qwen3_5GatedDeltaNet(nn.Module):
    """Gated DeltaNet over a state slot per sequence: conv state [C, K-1] and recurrent state [Hv, dk, dv].

    `in_proj_qkvz` fuses in_proj_qkv (q | k | v, the conv channels) and in_proj_z (the output
    gate); `in_proj_ba` fuses in_proj_b (-> beta) and in_proj_a (-> decay). Prefill sequences run
    the chunked kernel (chunk 64) from their slot (or from zeros when `has_initial_state` is False);
    single-token continuations run the recurrent kernel. Both update the slot in place. On CPU with an
    fp32 model, each kind is one C++ op (csrc/gdn_decode_cpu.cpp, csrc/gdn_prefill_cpu.cpp) that also
    does the conv and the gated norm (the prefill op runs the recurrence token by token, which was
    faster there than the chunked form); on a GPU with ASCENDSERVE_TRITON_KERNELS=1 the conv and the delta rule are
    Triton launches (layers/triton_ops.py; the prefill's delta rule token by token, or chunked with
    ASCENDSERVE_TRITON_CHUNKED_PREFILL=1); the plain-torch path below is the reference and the fallback.
    """

    # In a bf16 model on CPU the projections the fused fp32 ops read hand them their fp32 sums (prepack.py): no
    # rounding to bf16 and widening back (Qwen3.5 shape, 8 x 256 bf16 prefill: 296 ms of a 3.0 s step in those copies).
    fp32_output_linears = ("in_proj_qkvz", "in_proj_ba")

    def __init__(self, config) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.activation = config.hidden_act
        hidden = config.hidden_size
        self.in_proj_qkvz = nn.Linear(hidden, self.conv_dim + self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = RMSNormGated(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def shard_sizes(self, fused_name: str) -> list[int]:
        """Rows of each checkpoint projection inside `in_proj_qkvz` / `in_proj_ba`."""
        if fused_name == "in_proj_qkvz":
            return [self.conv_dim, self.value_dim]
        return [self.num_v_heads, self.num_v_heads]

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv state [C, K-1], recurrent state [Hv, dk, dv]) of one sequence."""
        return (self.conv_dim, self.conv_kernel_size - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        """hidden [T, H]; state = (conv pool, recurrent pool) of this layer; meta: the runner's StateMetadata."""
        qkvz, ba = self.in_proj_qkvz(hidden), self.in_proj_ba(hidden)
        if (kernels := self._cpu_kernels(qkvz, state)) is not None:
            out = self._fused(kernels, qkvz, ba, state, meta)
            return self.out_proj(out.to(hidden.dtype))
        mixed_qkv, z = qkvz.split([self.conv_dim, self.value_dim], dim=-1)
        core = _by_kind(
            meta, qkvz.new_empty(hidden.shape[0], self.num_v_heads, self.head_v_dim),
            lambda rows: self._decode(*_take(rows, mixed_qkv, ba), state, meta),
            lambda rows: self._prefill(*_take(rows, mixed_qkv, ba), state, meta))
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(hidden.shape[0], self.value_dim).to(hidden.dtype))

    def _cpu_kernels(self, qkvz: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]):
        """The CPU ops when the step can run as the fused C++ ops (an fp32 conv pool, an fp32 or bf16 recurrent pool,
        SiLU conv), else None. The ops compute in fp32: a bf16 model's projections are widened for them and their
        output rounded back (its conv pool is fp32 on CPU: state_cache_spec); a bf16 recurrent state
        (--mamba-ssm-cache-dtype bfloat16) is widened as it is read and rounded as it is written."""
        if qkvz.device.type != "cpu" or self.activation not in ("silu", "swish"):
            return None
        conv_pool, ssm_pool = state
        if (qkvz.dtype not in (torch.float32, torch.bfloat16) or conv_pool.dtype != torch.float32
                or ssm_pool.dtype not in (torch.float32, torch.bfloat16)):
            return None
        return cpu_kernels.ops()

    def _fp32_params(self) -> tuple[torch.Tensor, ...]:
        """(conv weight [C, K], A_log, dt_bias, gated-norm weight) in fp32 for the C++ ops: the parameters
        themselves in an fp32 model, else fp32 copies made once (the weights do not change after loading)."""
        params = (self.conv1d.weight.view(self.conv_dim, -1), self.A_log, self.dt_bias, self.norm.weight)
        if all(p.dtype == torch.float32 for p in params):
            return params
        cached = getattr(self, "_fp32_copies", None)
        if cached is None or cached[0] != tuple(p.data_ptr() for p in params):
            cached = (tuple(p.data_ptr() for p in params), tuple(p.detach().float().contiguous() for p in params))
            self._fp32_copies = cached
        return cached[1]

    def _fused(self, kernels, qkvz, ba, state, meta) -> torch.Tensor:
        """Conv, delta rule and gated norm of every row by the C++ ops: [T, Hv*dv] fp32, ready for out_proj. The
        prefill op reads a bf16 model's projections as they are (widened where it reads them: 2048 rows of qkvz
        took 2.7 ms a layer to copy to fp32); the decode op takes fp32 copies of its few rows."""
        conv_weight, a_log, dt_bias, norm_weight = self._fp32_params()
        weights = (conv_weight, *state)
        params = (a_log, dt_bias, norm_weight, self.num_k_heads, self.norm.eps)
        return _by_kind(
            meta, qkvz.new_empty(qkvz.shape[0], self.value_dim, dtype=torch.float32),
            lambda rows: kernels.gdn_decode(*(t.float() for t in _take(rows, qkvz, ba)), *weights, meta.decode_slots,
                                            *params),
            lambda rows: kernels.gdn_prefill(*_take(rows, qkvz, ba), *weights, meta.prefill_cu_seqlens,
                                             meta.prefill_slots, meta.prefill_has_initial_state, *params))

    def _split_heads(self, x: torch.Tensor):
        q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(-1, self.num_k_heads, self.head_k_dim), k.reshape(-1, self.num_k_heads, self.head_k_dim),
                v.reshape(-1, self.num_v_heads, self.head_v_dim))

    def _gates(self, ba: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta) from in_proj_ba's rows: the log-decay -exp(A_log) softplus(a + dt_bias) in fp32, sigmoid(b)."""
        b, a = ba.split([self.num_v_heads, self.num_v_heads], dim=-1)
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), b.sigmoid()

    def _decode(self, mixed_qkv, ba, state, meta) -> torch.Tensor:
        conv_states, ssm_states = state
        weight = self.conv1d.weight.squeeze(1)
        if (kernels := triton_kernels.ops_for(mixed_qkv)) is not None:  # the same two steps, one launch each
            x = kernels.causal_conv1d_decode(mixed_qkv, weight, conv_states, meta.decode_slots, self.activation)
            return kernels.gated_delta_rule_decode(x, ba, self.A_log, self.dt_bias, ssm_states, meta.decode_slots,
                                                   self.num_k_heads, self.head_k_dim, self.head_v_dim)
        x = causal_conv1d_decode(mixed_qkv, weight, conv_states, meta.decode_slots, activation=self.activation)
        q, k, v = self._split_heads(x)
        return recurrent_gated_delta_rule(q, k, v, *self._gates(ba), ssm_states, meta.decode_slots,
                                          slot_block=meta.decode_slot_block, use_qk_l2norm_in_kernel=True)

    def _prefill(self, mixed_qkv, ba, state, meta) -> torch.Tensor:
        conv_states, ssm_states = state
        slots, cu_seqlens, has_initial = meta.prefill_slots, meta.prefill_cu_seqlens, meta.prefill_has_initial_state
        weight = self.conv1d.weight.squeeze(1)
        if (kernels := triton_kernels.ops_for(mixed_qkv)) is not None and weight.shape[1] == 4:
            x = kernels.causal_conv1d_prefill(mixed_qkv, weight, conv_states, cu_seqlens, slots, has_initial,
                                              self.activation)
            delta_rule = kernels.chunk_gated_delta_rule if triton_kernels.chunked_prefill() else \
                kernels.gated_delta_rule_prefill
            return delta_rule(x, ba, self.A_log, self.dt_bias, ssm_states, cu_seqlens, slots, has_initial,
                              self.num_k_heads, self.head_k_dim, self.head_v_dim)
        g, beta = self._gates(ba)
        x = causal_conv1d_prefill(mixed_qkv, weight, conv_states, cu_seqlens, slots, has_initial,
                                  activation=self.activation)
        q, k, v = self._split_heads(x)
        # A fresh sequence starts from zeros whatever its slot held before.
        initial = torch.where(has_initial[:, None, None, None], ssm_states[slots], 0.0)
        out, final = chunk_gated_delta_rule(q, k, v, g, beta, initial, cu_seqlens, 64,
                                            use_qk_l2norm_in_kernel=True)
        ssm_states[slots] = final.to(ssm_states.dtype)
        return out


def _take(rows: torch.Tensor | slice | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The given rows of each tensor: all of them, uncopied, when rows is None; a slice's rows as a view where that
    is contiguous (else a contiguous copy, as an index gives)."""
    if rows is None:
        return tensors
    if isinstance(rows, slice):
        return tuple(t[rows].contiguous() for t in tensors)
    return tuple(t[rows] for t in tensors)


def _by_kind(meta, out: torch.Tensor, decode, prefill) -> torch.Tensor:
    """decode(rows) and prefill(rows) over the step's rows of each kind; rows None means every row, in order.

    `out` (the full result's shape, unwritten) is filled only when the step mixes both kinds (the
    builder gives prefill rows only next to decode rows); otherwise the one call's result is returned.
    """
    if meta.prefill_cu_seqlens is None:
        return decode(None)
    if meta.prefill_token_idx is None:
        return prefill(None)
    if meta.split_row is not None:  # decodes first: both kinds as row slices (views)
        decode_rows, prefill_rows = slice(0, meta.split_row), slice(meta.split_row, None)
    else:
        decode_rows, prefill_rows = meta.decode_token_idx, meta.prefill_token_idx
    out[decode_rows] = decode(decode_rows)
    out[prefill_rows] = prefill(prefill_rows)
    return out


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm mixer (Gated DeltaNet or gated attention) and MLP (dense or MoE) with residuals."""

    def __init__(self, config, layer_type: str, rotary: MRotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = Qwen3_5GatedDeltaNet(config)
        else:
            self.self_attn = Qwen3_5Attention(config, rotary)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, cache, attn_meta, state_meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the caller adds the two (the next
        layer's input norm or the final norm does, in one op with its norm)."""
        if residual is None:
            residual, x = hidden, self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            x = self.linear_attn(x, cache, state_meta)
        else:
            x = self.self_attn(positions, x, cache, attn_meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3_5Model(nn.Module):
    """Embedding, the hybrid decoder layers and the final norm."""

    def __init__(self, config, make_mlp) -> None:
        super().__init__()
        head_dim = config.head_dim
        params = config.rope_parameters or {}
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq, scaling = rope_inv_freq(config, rotary_dim)
        rotary = MRotaryEmbedding(inv_freq, scaling, position_limit(config) or config.max_position_embeddings,
                                  params.get("mrope_section", [11, 11, 10]))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layer_types = list(config.layer_types[:config.num_hidden_layers])
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, t, rotary, make_mlp(config))
                                    for t in self.layer_types)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # Layer i reads kv_caches[cache_index[i]] (full attention) or state_caches[cache_index[i]].
        # Example, [lin, lin, lin, full, lin]: cache_index [0, 1, 2, 0, 3].
        counts = {"linear_attention": 0, "full_attention": 0}
        self.cache_index = []
        for t in self.layer_types:
            self.cache_index.append(counts[t])
            counts[t] += 1

    def forward(self, input_ids, positions, kv_caches, attn_meta, state_caches, state_meta) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, index in zip(self.layers, self.cache_index):
            cache = state_caches[index] if layer.is_linear else kv_caches[index]
            hidden, residual = layer(positions, hidden, residual, cache, attn_meta, state_meta)
        return self.norm(hidden, residual)[0] if residual is not None else self.norm(hidden)


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3.5 (dense) text model with its LM head; also serves Qwen3_5ForConditionalGeneration's text path."""

    # compute_logits is lm_head(hidden) and nothing more: greedy rows may take the lm_head's fused argmax instead
    # (ModelRunner._fused_greedy); a subclass that scales or masks the logits sets this False.
    greedy_from_lm_head = True

    # checkpoint name piece -> (fused parameter name piece, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
        "in_proj_qkv": ("in_proj_qkvz", 0), "in_proj_z": ("in_proj_qkvz", 1),
        "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1),
    }

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config  # the checkpoint's config (composite for *ForConditionalGeneration)
        self.text_config = config.get_text_config()
        self.model = Qwen3_5Model(self.text_config, self.make_mlp)
        self.lm_head = nn.Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def make_mlp(config) -> nn.Module:
        """The MLP of one decoder layer."""
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def _layers_of(self, kind: str) -> list[nn.Module]:
        return [getattr(layer, kind) for layer in self.model.layers if hasattr(layer, kind)]

    def kv_cache_spec(self) -> dict:
        """Shape of the paged KV cache: one per full-attention layer."""
        attn = self._layers_of("self_attn")
        return {"num_layers": len(attn), "num_kv_heads": attn[0].num_kv_heads, "head_dim": attn[0].head_dim}

    def state_cache_spec(self) -> dict:
        """Shape of the per-sequence state: one conv and one fp32 recurrent state per Gated DeltaNet layer. The
        conv state is fp32 on CPU, where the C++ ops compute in fp32 whatever the model's dtype; elsewhere it is
        in the model's dtype (conv_dtype None). The engine may change either dtype (--mamba-cache-dtype,
        --mamba-ssm-cache-dtype: worker/model_runner.py's state_cache_spec)."""
        linear = self._layers_of("linear_attn")
        conv_shape, ssm_shape = linear[0].state_shapes()
        on_cpu = self.model.embed_tokens.weight.device.type == "cpu"
        return {"num_layers": len(linear), "conv_shape": conv_shape, "ssm_shape": ssm_shape,
                "ssm_dtype": torch.float32, "conv_dtype": torch.float32 if on_cpu else None}

    def forward(self, input_ids, positions, kv_caches, attn_meta, state_caches, state_meta) -> torch.Tensor:
        """Hidden states [T, hidden] of the packed tokens; positions [T] (text) or [3, T] (MRoPE)."""
        return self.model(input_ids, positions, kv_caches, attn_meta, state_caches, state_meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits for the rows that sample."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (text-only or composite layout) into the fused parameters."""
        loader = StackedLoader(self, self.packed_modules, self._shard_sizes)
        skip = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if self.tie_word_embeddings else ())
        return loader.load(self.preprocess_weights(text_weights(weights)), skip=skip)

    def preprocess_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Hook for layouts that need rewriting before loading (MoE experts)."""
        return weights

    def _shard_sizes(self, fused_name: str, module: nn.Module) -> list[int]:
        if fused_name == "qkv_proj":
            return module.shard_sizes()
        if fused_name == "gate_up_proj":
            return [module.intermediate_size] * 2
        return module.shard_sizes(fused_name)


def text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Composite checkpoint names -> text-model names: `model.language_model.X` -> `model.X`.

    Tensors under `model.visual.` and `mtp.` are dropped, with one log line at the end.
    """
    skipped = 0
    for name, tensor in weights:
        if name.startswith(UNUSED_PREFIXES):
            skipped += 1
            continue
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        yield name, tensor
    if skipped:
        logger.info("Skipped %d checkpoint tensors under %s (vision tower and MTP head are not used "
                    "by the text model)", skipped, ", ".join(p + "*" for p in UNUSED_PREFIXES))
