"""Tiny random Qwen3.5 checkpoints (dense, bf16-valued dense, MoE, composite VL) and their transformers references,
shared by the engine-path tests (tests/models/test_qwen3_5_parity.py, tests/worker, tests/cuda)."""

import os

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

from ascendserve import SamplingParams
from tests.models.reference import hf_greedy, make_prompts

VOCAB = 512
MAX_NEW = 8
LENGTHS = [1, 7, 64, 65, 130, 300]  # crosses multiples of 64 (the delta-rule chunk) and of 16 (blocks)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1], "mrope_interleaved": True}
TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
            rms_norm_eps=1e-6, rope_parameters=ROPE)  # layers: 3 Gated DeltaNet + 1 full attention
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    """Every parameter random: (1 + w) norms, A_log, dt_bias and conv weights around 0, the gated norm around 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            values = torch.randn(param.shape, generator=gen) * std
            if name.endswith("linear_attn.norm.weight"):  # the one plain-weight RMSNorm
                values += 1.0
            param.copy_(values)


def build(kind: str):
    """The transformers model of a tiny random checkpoint (dense-bf16: dense with bf16-valued weights)."""
    if kind in ("dense", "dense-bf16"):
        config = Qwen3_5TextConfig(**TEXT, intermediate_size=128, tie_word_embeddings=True)
        arch = "Qwen3_5ForCausalLM"
    elif kind == "moe":
        config = Qwen3_5MoeTextConfig(**TEXT, **MOE, tie_word_embeddings=False)
        arch = "Qwen3_5MoeForCausalLM"
    else:
        config = Qwen3_5Config(text_config={**TEXT, "intermediate_size": 128}, vision_config=VISION,
                               tie_word_embeddings=False)
        arch = "Qwen3_5ForConditionalGeneration"
    config.architectures = [arch]
    torch.manual_seed(0)
    if kind == "vl":
        model = Qwen3_5ForConditionalGeneration(config).to(torch.float32).eval()
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed=1)
    if kind == "dense-bf16":  # every value exactly bf16; the reference still computes in fp32
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.bfloat16().float())
    return model


def checkpoint_cache(tmp_path_factory):
    """A function kind -> (path, prompts, transformers' CPU fp32 references) that builds each kind once (the
    `checkpoints` fixture of this module and of the other engine-path tests)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            model = build(kind)
            path = tmp_path_factory.mktemp(kind)
            if kind == "dense-bf16":  # saved as bf16, like the released checkpoints
                model.to(torch.bfloat16).save_pretrained(path)
                model.float()
            else:
                model.save_pretrained(path)
            names = load_file(os.path.join(path, "model.safetensors")).keys()
            if kind == "vl":  # the real composite layout
                assert any(n.startswith("model.language_model.layers.") for n in names)
                assert any(n.startswith("model.visual.") for n in names)
            prompts = make_prompts(VOCAB, LENGTHS, seed=2)
            cache[kind] = str(path), prompts, [hf_greedy(model, p, MAX_NEW) for p in prompts]
        return cache[kind]
    return get


def greedy_params(**overrides) -> SamplingParams:
    """Greedy, MAX_NEW tokens, the sampled token's logprob, past EOS (any field overridden)."""
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_NEW, "logprobs": 0, "ignore_eos": True, **overrides})


def assert_pools_clean(engine):
    """No KV block in use and every state slot free: nothing leaked by the run."""
    free, cached, in_use = engine.kv_cache_manager.pool.counts()
    assert in_use == 0 and free + cached == engine.kv_cache_manager.num_blocks
    state = engine.state_cache_manager
    assert state.num_free_slots == state.num_slots and not state.req_to_slot


def assert_near_reference(outputs, refs, max_drift: float, min_gap: float) -> None:
    """A not bit-exact run against transformers' fp32 greedy references: each output keeps the reference's tokens
    with logprobs within max_drift until it parts where the reference's top two were under min_gap apart, and at
    least half of the outputs never part."""
    whole = 0
    for out, ref in zip(outputs, refs):
        tokens, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
        step = next((i for i, (a, b) in enumerate(zip(tokens, ref.tokens)) if a != b), len(tokens))
        drift = [abs(logprobs[i][tokens[i]].logprob - ref.logprobs[i]) for i in range(step)]
        assert max(drift, default=0.0) < max_drift, drift
        assert step == len(tokens) or ref.top2_gap[step] < min_gap, (step, ref.top2_gap[step])
        whole += step == len(tokens)
    assert whole >= len(outputs) // 2


TRITON_KERNELS = ("causal_conv1d_decode", "gated_delta_rule_decode", "paged_decode", "causal_conv1d_prefill",
                  "gated_delta_rule_prefill")
CHUNKED_PREFILL_KERNEL = "chunk_gated_delta_rule"  # in gated_delta_rule_prefill's place with CHUNKED_PREFILL_ENV=1


def record_triton_calls(monkeypatch) -> list[str]:
    """Turn on the Triton kernels (ASCENDSERVE_TRITON_KERNELS=1) and return the list their calls are recorded
    in, by name: a test then shows the engine took them rather than the torch forms."""
    from ascendserve.layers import triton_kernels, triton_ops
    monkeypatch.setenv(triton_kernels.ENV_VAR, "1")
    calls: list[str] = []
    for name in TRITON_KERNELS + (CHUNKED_PREFILL_KERNEL,):
        fn = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    return calls
