"""Llama / Qwen2 / Qwen3 against transformers on tiny random checkpoints, through every engine path."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from ascendserve import LLM, SamplingParams
from ascendserve.compilation import compiled_module_classes
from tests.models.reference import assert_matches, check_outputs, hf_greedy, make_prompts, randomize_

VOCAB = 512
MAX_NEW = 12
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
CONFIGS = {  # each takes overrides of COMMON
    "llama": lambda **o: LlamaConfig(**{**COMMON, **o}, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                                         "factor": 8.0, "low_freq_factor": 1.0,
                                                                         "high_freq_factor": 4.0,
                                                                         "original_max_position_embeddings": 64}),
    "qwen2": lambda **o: Qwen2Config(**{**COMMON, "tie_word_embeddings": True, **o}),
    "qwen3": lambda **o: Qwen3Config(**{**COMMON, **o}, head_dim=32),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
LENGTHS = [1, 7, 16, 17, 64, 100, 255, 300]  # crosses block (16) boundaries


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    config = CONFIGS[request.param]()
    config.architectures = [ARCHITECTURES[request.param]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed=1)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    prompts = make_prompts(VOCAB, LENGTHS, seed=2) + make_prompts(VOCAB, [40, 90, 130], seed=3, shared_prefix=35)
    refs = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    return str(path), prompts, refs


def _generate(path, prompts, **engine_args):
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outputs


def _assert_pool_clean(llm):
    pool = llm.llm_engine.kv_cache_manager.pool
    free, cached, in_use = pool.counts()
    assert in_use == 0 and free + cached == pool.num_blocks


@pytest.mark.parametrize("enforce_eager", [True, False])  # False: norms, activation, rotary compiled
def test_default_engine(checkpoint, enforce_eager, monkeypatch):
    monkeypatch.setenv("ASCENDSERVE_COMPILE", "1")  # whatever this platform's default
    path, prompts, refs = checkpoint
    llm, outputs = _generate(path, prompts, num_gpu_blocks_override=256, enforce_eager=enforce_eager)
    check_outputs(outputs, refs)
    compilable = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, compiled_module_classes())]
    assert len(compilable) >= 8 and all(("forward" in vars(m)) != enforce_eager for m in compilable)
    _assert_pool_clean(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_and_prefix_cache(checkpoint, async_scheduling):
    path, prompts, refs = checkpoint
    llm, outputs = _generate(path, prompts, num_gpu_blocks_override=256, max_num_batched_tokens=48,
                             enable_prefix_caching=True, async_scheduling=async_scheduling)
    check_outputs(outputs, refs)
    assert llm.llm_engine.kv_cache_manager.num_hits > 0  # the shared-prefix prompts hit
    # a second pass hits the cache for every full block and still matches
    again = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0, ignore_eos=True),
                         use_tqdm=False)
    assert max(o.num_cached_tokens for o in again) >= 288
    check_outputs(again, refs)
    _assert_pool_clean(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption(checkpoint, async_scheduling):
    path, prompts, refs = checkpoint
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # short first: many admitted at once
    prompts, refs = [prompts[i] for i in order], [refs[i] for i in order]
    # 78 blocks of 4 tokens: the longest request (312 tokens) needs 78, and running requests grow by
    # 3 blocks each while decoding, so the newest running requests must be preempted and recomputed.
    llm, outputs = _generate(path, prompts, num_gpu_blocks_override=78, block_size=4, max_model_len=312,
                             enable_prefix_caching=False, async_scheduling=async_scheduling)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    check_outputs(outputs, refs)
    _assert_pool_clean(llm)


@pytest.mark.parametrize("budget", [48, 2048])  # chunked prefill; whole prompts in one step
def test_bf16_model_on_the_bf16_kernel(tmp_path, budget):
    # --dtype bfloat16 on CPU: every linear on Bf16Linear.for_bf16 (vdpbf16ps where the CPU has AVX512-BF16),
    # against transformers' fp32 model of the same bf16 weights; bf16 activations round at every layer, so
    # logprobs agree to ~0.1 and greedy tokens may part only where transformers' best two are that close.
    from ascendserve.layers import cpu_kernels
    from ascendserve.layers.compact_linear import Bf16GateUpSilu, Bf16Linear
    config = CONFIGS["qwen3"]()
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed=1)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    model.float()
    prompts = make_prompts(VOCAB, LENGTHS, seed=2)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", num_gpu_blocks_override=256,
              max_num_batched_tokens=budget)
    kinds = (torch.nn.Linear, Bf16Linear, Bf16GateUpSilu)
    linears = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, kinds)]
    # per layer qkv, o, gate_up, down; and the lm_head; on AMX or AVX512-BF16 the gate_up layers apply SiLU-and-mul too
    assert len(linears) == 2 * 4 + 1 and all(isinstance(m, kinds[1:]) and m.bf16_io for m in linears)
    fused = sum(isinstance(m, Bf16GateUpSilu) for m in linears)
    kernels = cpu_kernels.ops()
    assert fused == (2 if kernels is not None and (kernels.bf16_amx() or kernels.bf16_dot()) else 0)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        assert_matches(hf_greedy(model, prompt, MAX_NEW), completion.token_ids, completion.logprobs, tol=0.1)
    _assert_pool_clean(llm)
    # without logprobs every row only takes the argmax: on AMX or vdpbf16ps the lm_head's fused argmax gives the tokens
    # (no logits made), the same as the sampler's argmax over the logits above
    head, picks = llm.llm_engine.runner.model.lm_head, []
    fused = head.argmax
    head.argmax = lambda x: picks.append(fused(x)) or picks[-1]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
    assert picks and all((p is not None) == (kernels.bf16_amx() or kernels.bf16_dot()) for p in picks)


@pytest.mark.parametrize("name", sorted(CONFIGS))  # qkv bias (qwen2), per-head q / k norms (qwen3)
def test_bf16_decode_loop_is_the_modules(tmp_path, name, monkeypatch):
    # A bf16 model whose layers all run on the CPU kernels hands its decode steps to one op (llama_cpu_decode.py,
    # csrc/llama_decode_cpu.cpp): the same ops on the same tensors in the same order as the modules, so the same tokens
    # and logprobs, bit for bit, through steps that mix prefills and decodes (the modules) and decode-only steps (the
    # op). Against transformers it runs in test_bf16_model_on_the_bf16_kernel (its decode steps take the op).
    from ascendserve.layers import cpu_kernels
    from ascendserve.models.llama_cpu_decode import CpuDecodeLoop
    config = CONFIGS[name](hidden_size=128)  # head_dim 32: the decode kernel's bf16 queries (else widened: no loop)
    config.architectures = [ARCHITECTURES[name]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed=1)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    prompts = make_prompts(VOCAB, [1, 9, 16, 40, 77], seed=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=2, ignore_eos=True)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", num_gpu_blocks_override=128,
              enable_prefix_caching=False)
    calls = []
    call = CpuDecodeLoop.__call__
    monkeypatch.setattr(CpuDecodeLoop, "__call__", lambda self, *args: calls.append(1) or call(self, *args))
    with_loop = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kernels = cpu_kernels.ops()
    runs = kernels is not None and bool(kernels.bf16_amx() or kernels.bf16_dot()) and kernels.paged_decode_bf16_dot(32)
    assert bool(calls) == runs  # where the kernels lack the fused gate-and-up or bf16 queries, the modules run
    if not runs:
        return
    decoder = llm.llm_engine.runner.model.model
    monkeypatch.setattr(CpuDecodeLoop, "build", classmethod(lambda cls, m: None))
    decoder._cpu_decode = ((), None)  # stale: built again, as None
    calls.clear()
    by_modules = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert not calls and decoder._cpu_decode[1] is None
    for a, b in zip(with_loop, by_modules):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in a.outputs[0].logprobs] == \
               [{t: lp.logprob for t, lp in step.items()} for step in b.outputs[0].logprobs]
