"""The KV pool's size on the CPU: vLLM-CPU's VLLM_CPU_KVCACHE_SPACE, a flag that does nothing there said so, and a
size asked for that the memory cannot hold refused before it is allocated."""
import logging

import pytest

from ascendserve import LLM, SamplingParams
from ascendserve.platforms.cpu import CpuPlatform
from tests.models.llama_tiny import build_llama

GiB = 1 << 30


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("llama"))[0]


def _llm(path, **kwargs):
    return LLM(path, skip_tokenizer_init=True, dtype="float32", max_model_len=128, **kwargs)


def _cache_log(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache ("))


def test_vllm_cpus_kv_cache_space_sizes_the_pool(llama, monkeypatch, caplog):
    # 2 layers x 2 (K, V) x 2 heads x 16 dims x 4 bytes = 512 bytes a token, 8 KiB a 16-token block
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.001")
    with caplog.at_level(logging.INFO):
        engine = _llm(llama).llm_engine
    assert engine.kv_cache_manager.num_blocks == int(0.001 * GiB) // 8192 == 131
    assert _cache_log(caplog).startswith("KV cache (VLLM_CPU_KVCACHE_SPACE): 131 blocks")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")  # vLLM's 'unset'
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _llm(llama)
    assert _cache_log(caplog).startswith("KV cache (cpu default)")


@pytest.mark.parametrize("value", ["forty", "-1", "nan"])
def test_a_bad_kv_cache_space_is_named(llama, monkeypatch, value):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
    with pytest.raises(ValueError, match=rf"VLLM_CPU_KVCACHE_SPACE must be the KV cache size in GiB .* got '{value}'"):
        _llm(llama)


def test_gpu_memory_utilization_on_the_cpu_is_said_to_do_nothing(llama, caplog):
    with caplog.at_level(logging.WARNING):
        _llm(llama, gpu_memory_utilization=0.5)
    assert "gpu_memory_utilization=0.5 has no effect on the CPU" in caplog.text and "VLLM_CPU_KVCACHE_SPACE" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _llm(llama, kv_cache_memory_bytes=1 << 20)  # the default 0.9, and a size given: nothing to say
    assert "gpu_memory_utilization" not in caplog.text


@pytest.mark.parametrize("kwargs, source", [({"kv_cache_memory_bytes": 1 << 40}, "kv_cache_memory_bytes"),
                                            ({"num_gpu_blocks_override": 1 << 28}, "num_gpu_blocks_override")])
def test_a_pool_larger_than_the_free_memory_is_refused_before_allocating(llama, monkeypatch, kwargs, source):
    monkeypatch.setattr(CpuPlatform, "mem_get_info", lambda self: (8 * GiB, 16 * GiB))
    with pytest.raises(ValueError, match=rf"the KV cache asked for \({source}\) takes \d+\.\d\d GiB, more than the "
                                         r"8.00 GiB of cpu memory free now, after the weights; give it less"):
        _llm(llama, **kwargs)


@pytest.mark.parametrize("value", ["auto", -1])
def test_max_model_len_auto_is_what_the_cache_holds(llama, caplog, value):
    """vLLM's `--max-model-len auto`: the model's 512 positions, cut to the 10 blocks' 160 tokens the cache holds
    (a fixed 512 is the 'KV cache holds 10 blocks' error)."""
    with caplog.at_level(logging.WARNING):
        llm = LLM(llama, skip_tokenizer_init=True, dtype="float32", max_model_len=value, num_gpu_blocks_override=10)
    assert llm.llm_engine.config.max_model_len == 160
    assert "max_model_len auto: 160 tokens, what the KV cache holds (the model allows 512)" in caplog.text
    out = llm.generate({"prompt_token_ids": list(range(1, 150))}, SamplingParams(max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) <= 160
    big = LLM(llama, skip_tokenizer_init=True, dtype="float32", max_model_len=value, num_gpu_blocks_override=64)
    assert big.llm_engine.config.max_model_len == 512  # the model's own limit when the cache holds more
    with pytest.raises(ValueError, match="holds 10 blocks"):
        LLM(llama, skip_tokenizer_init=True, dtype="float32", max_model_len=512, num_gpu_blocks_override=10)
