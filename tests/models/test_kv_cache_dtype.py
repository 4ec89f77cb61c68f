"""--kv-cache-dtype bfloat16 / float16 under an fp32 model, against transformers' fp32 model.

K/V are stored rounded to 16 bits and read back widened, so the outputs are not bit-exact: greedy tokens
must match transformers' except where its two best logits are within TOL (a near tie the rounding may
flip), and every logprob must be within TOL of transformers'. Measured here: largest logprob drift 0.033
(llama, bf16), 0.003 (llama, fp16), 0.001 (Qwen3.5, bf16); the only flips at top-two gaps of 0.001-0.007.
Through every engine path: mixed batches, chunked prefill, prefix-cache hits, preemption, the plain-torch
decode path.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from ascendserve import LLM, SamplingParams
from ascendserve.layers import cpu_kernels
from tests.models import test_llama_parity as llama
from tests.models import qwen3_5_tiny as qwen
from tests.models.reference import assert_matches, hf_greedy, make_prompts, randomize_

TOL = 0.08


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    config = llama.CONFIGS["llama"]()
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed=1)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    prompts = (make_prompts(llama.VOCAB, llama.LENGTHS, seed=2)
               + make_prompts(llama.VOCAB, [40, 90, 130], seed=3, shared_prefix=35))
    return str(path), prompts, [hf_greedy(model, p, llama.MAX_NEW) for p in prompts]


@pytest.fixture(scope="module")
def qwen_checkpoint(tmp_path_factory):
    model = qwen.build("dense")
    path = tmp_path_factory.mktemp("qwen3_5")
    model.save_pretrained(path)
    prompts = make_prompts(qwen.VOCAB, qwen.LENGTHS, seed=2)
    return str(path), prompts, [hf_greedy(model, p, qwen.MAX_NEW) for p in prompts]


def _run(path, prompts, refs, max_new, cache_dtype=torch.bfloat16, **engine_args):
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype=str(cache_dtype).split(".")[1],
              **engine_args)
    engine = llm.llm_engine
    assert all(c.dtype == cache_dtype for c in engine.runner.kv_caches)
    params = SamplingParams(temperature=0, max_tokens=max_new, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outputs, refs):
        assert out.outputs[0].finish_reason == "length"
        assert_matches(ref, out.outputs[0].token_ids, out.outputs[0].logprobs, tol=TOL)
    return llm, outputs


def _assert_clean(engine):
    free, cached, in_use = engine.kv_cache_manager.pool.counts()
    assert in_use == 0 and free + cached == engine.kv_cache_manager.num_blocks
    if engine.state_cache_manager is not None:
        assert engine.state_cache_manager.num_free_slots == engine.state_cache_manager.num_slots


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_llama_mixed_batch(llama_checkpoint, cache_dtype):
    llm, _ = _run(*llama_checkpoint, llama.MAX_NEW, cache_dtype, num_gpu_blocks_override=256)
    _assert_clean(llm.llm_engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_llama_chunked_prefill_and_prefix_cache_hits(llama_checkpoint, async_scheduling):
    path, prompts, refs = llama_checkpoint
    llm, _ = _run(path, prompts, refs, llama.MAX_NEW, num_gpu_blocks_override=256, max_num_batched_tokens=48,
                  enable_prefix_caching=True, async_scheduling=async_scheduling)
    assert llm.llm_engine.kv_cache_manager.num_hits > 0
    again = llm.generate([{"prompt_token_ids": p} for p in prompts],  # every full block from the cache
                         SamplingParams(temperature=0, max_tokens=llama.MAX_NEW, logprobs=0, ignore_eos=True),
                         use_tqdm=False)
    assert max(o.num_cached_tokens for o in again) >= 288
    for out, ref in zip(again, refs):
        assert_matches(ref, out.outputs[0].token_ids, out.outputs[0].logprobs, tol=TOL)
    _assert_clean(llm.llm_engine)


def test_llama_preemption(llama_checkpoint):
    path, prompts, refs = llama_checkpoint
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    llm, _ = _run(path, [prompts[i] for i in order], [refs[i] for i in order], llama.MAX_NEW,
                  num_gpu_blocks_override=78, block_size=4, max_model_len=312, enable_prefix_caching=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _assert_clean(llm.llm_engine)


def test_llama_plain_torch_decode_path(llama_checkpoint, monkeypatch):
    monkeypatch.setitem(cpu_kernels._state, "ops", None)  # gather + SDPA, the path other devices take
    llm, _ = _run(*llama_checkpoint, llama.MAX_NEW, num_gpu_blocks_override=256)
    _assert_clean(llm.llm_engine)


@pytest.mark.parametrize("budget", [48, 1024])
def test_qwen3_5_hybrid(qwen_checkpoint, budget):
    llm, _ = _run(*qwen_checkpoint, qwen.MAX_NEW, num_gpu_blocks_override=256, max_num_batched_tokens=budget)
    _assert_clean(llm.llm_engine)


def test_qwen3_5_preemption(qwen_checkpoint):
    path, prompts, refs = qwen_checkpoint
    order = [qwen.LENGTHS.index(n) for n in (300, 7, 1, 130, 65, 64)]
    llm, _ = _run(path, [prompts[i] for i in order], [refs[i] for i in order], qwen.MAX_NEW,
                  num_gpu_blocks_override=78, block_size=4, max_model_len=312)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _assert_clean(llm.llm_engine)


def test_half_the_bytes_per_block_doubles_the_blocks_of_a_memory_budget(llama_checkpoint):
    path = llama_checkpoint[0]
    blocks = {dtype: LLM(path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype=dtype,
                         kv_cache_memory_bytes=8 << 20).llm_engine.kv_cache_manager.num_blocks
              for dtype in ("auto", "bfloat16")}
    assert blocks["bfloat16"] == 2 * blocks["auto"] > 0


@pytest.mark.parametrize("value, message", [
    ("fp8", "kv_cache_dtype 'fp8' is not supported: fp8 KV caches are not implemented"),
    ("fp8_e5m2", "is not supported"),
    ("float32", "kv_cache_dtype must be one of ['auto', 'bfloat16', 'float16'], got 'float32'"),
    (None, "kv_cache_dtype must be one of"),
])
def test_bad_kv_cache_dtype_is_a_value_error_naming_the_field(value, message):
    from ascendserve.config import EngineArgs
    with pytest.raises(ValueError) as info:
        EngineArgs.from_kwargs(kv_cache_dtype=value)
    assert message in str(info.value)
