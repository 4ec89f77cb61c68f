"""The CUDA path against transformers: Qwen3.5 (dense, MoE, composite VL) and Llama, tiny random checkpoints, on a GPU.

The same references as tests/models (transformers' fp32 model on the CPU, greedy, one prompt at a time) and the same
engine paths: mixed batches, chunked prefill at budgets that do and do not align with the delta rule's chunks, prefix
cache hits, recompute preemption, requests joining while others decode, async scheduling, compiled and eager; then bf16
and the real server process. Every model tensor, cache and state pool must live on the GPU.

Skipped where torch sees no CUDA device (CI, laptops); run on a GPU machine with
`python -m pytest tests/cuda` (benchmarks/cuda_run.sh does, before the GPU benchmark). ASCENDSERVE_TEST_DEVICE names
another device for the same tests (`npu`; `cpu` checks the tests themselves where no accelerator is at hand).
"""

import os
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from ascendserve import LLM, SamplingParams
from ascendserve.config import EngineArgs
from ascendserve.engine.llm_engine import LLMEngine
from ascendserve.layers import cpu_kernels, triton_kernels
from ascendserve.platforms import get_platform
from ascendserve.worker.decode_graphs import EAGER_ENV
from tests.models.llama_tiny import LLAMA_NEW, build_llama
from tests.models.qwen3_5_tiny import (CHUNKED_PREFILL_KERNEL, LENGTHS, MAX_NEW, TEXT, TRITON_KERNELS,
                                       assert_near_reference, assert_pools_clean, checkpoint_cache, greedy_params,
                                       record_triton_calls)
from tests.models.reference import check_outputs, generate_with_arrivals

DEVICE = os.environ.get("ASCENDSERVE_TEST_DEVICE", "cuda")


def _available(device: str) -> bool:
    try:
        return get_platform(device) is not None
    except ValueError:  # not available in this process
        return False


pytestmark = pytest.mark.skipif(not _available(DEVICE), reason=f"no {DEVICE} device: its path is not run here")

# A tokenizer directory for the server test (tests/fixtures/qwen3_5_tokenizer.py builds one; the GPU machine cannot
# fetch its ranks, so benchmarks/cuda_run.sh carries a built copy and names it here).
TOKENIZER_ENV = "ASCENDSERVE_TEST_QWEN3_5_TOKENIZER"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory)


def _llm(path, dtype="float32", **engine_args):
    return LLM(path, skip_tokenizer_init=True, dtype=dtype, device=DEVICE, **engine_args)


def _generate(llm, prompts, params=None):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params or greedy_params(), use_tqdm=False)


def _assert_on_device(engine) -> None:
    runner = engine.runner
    assert runner.device.type == DEVICE
    tensors = [*runner.model.parameters(), *runner.model.buffers(), *runner.kv_caches]
    tensors += [t for pair in runner.state_caches or [] for t in pair]
    assert tensors and all(t.device.type == DEVICE for t in tensors), {str(t.device) for t in tensors}


@pytest.mark.parametrize("kind,budget,enforce_eager", [("dense", 16, True), ("dense", 100, True),
                                                       ("dense", 100, False), ("moe", 48, True), ("vl", 100, True)])
def test_qwen3_5_matches_transformers(checkpoints, kind, budget, enforce_eager):
    path, prompts, refs = checkpoints(kind)
    llm = _llm(path, num_gpu_blocks_override=256, max_num_batched_tokens=budget, enforce_eager=enforce_eager)
    _assert_on_device(llm.llm_engine)
    check_outputs(_generate(llm, prompts), refs)
    assert_pools_clean(llm.llm_engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_qwen3_5_preemption(checkpoints, async_scheduling):
    path, prompts, refs = checkpoints("dense")
    order = [LENGTHS.index(n) for n in (300, 7, 1, 130, 65, 64)]
    prompts, refs = [prompts[i] for i in order], [refs[i] for i in order]
    llm = _llm(path, num_gpu_blocks_override=78, block_size=4, max_model_len=312, async_scheduling=async_scheduling,
               enforce_eager=True)
    check_outputs(_generate(llm, prompts), refs)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_pools_clean(llm.llm_engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_qwen3_5_requests_join_while_others_decode(checkpoints, async_scheduling):
    path, prompts, refs = checkpoints("dense")
    engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(
        path, skip_tokenizer_init=True, dtype="float32", device=DEVICE, num_gpu_blocks_override=256,
        max_num_batched_tokens=40, max_num_seqs=3, async_scheduling=async_scheduling, enforce_eager=True))
    check_outputs(generate_with_arrivals(engine, prompts, greedy_params()), refs)
    assert_pools_clean(engine)


@pytest.mark.parametrize("budget", [48, 1024])
def test_qwen3_5_bf16(checkpoints, budget):
    # --dtype bfloat16 on the GPU (what --dtype auto picks there) against transformers' fp32 model of the same bf16
    # weights: logprobs within 0.15 until a reference step whose best two were under 0.5 apart. The CPU's bf16 path
    # stays within 0.1 (its Gated DeltaNet widens to fp32); the H200's bf16 GEMMs and torch ops drifted 0.105 at
    # budget 48 (2026-12-04), so 0.1 would fail on rounding alone while a wrong value still drifts by far more.
    path, prompts, refs = checkpoints("dense-bf16")
    llm = _llm(path, dtype="bfloat16", num_gpu_blocks_override=256, max_num_batched_tokens=budget, enforce_eager=True)
    _assert_on_device(llm.llm_engine)
    assert_near_reference(_generate(llm, prompts), refs, max_drift=0.15, min_gap=0.5)
    assert_pools_clean(llm.llm_engine)


@pytest.mark.skipif(DEVICE == "cpu", reason="--dtype auto on a CPU depends on its bf16 support")
def test_qwen3_5_auto_dtype_is_bf16_on_the_accelerator(checkpoints):
    path, _, _ = checkpoints("dense")  # an fp32 checkpoint: --dtype auto narrows it to bf16 on a GPU, as vLLM does
    llm = LLM(path, skip_tokenizer_init=True, device=DEVICE, num_gpu_blocks_override=64, enforce_eager=True)
    assert llm.llm_engine.config.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_llama(tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_llama_chunked_prefill_and_prefix_cache(llama, async_scheduling):
    path, prompts, refs = llama
    llm = _llm(path, num_gpu_blocks_override=256, max_num_batched_tokens=48, enable_prefix_caching=True,
               async_scheduling=async_scheduling, enforce_eager=True)
    _assert_on_device(llm.llm_engine)
    check_outputs(_generate(llm, prompts, greedy_params(max_tokens=LLAMA_NEW)), refs)
    again = _generate(llm, prompts, greedy_params(max_tokens=LLAMA_NEW))  # every full block of every prompt is now cached
    assert max(o.num_cached_tokens for o in again) >= 288
    check_outputs(again, refs)
    _assert_clean_pool(llm)


def test_llama_preemption_compiled(llama):
    path, prompts, refs = llama
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    prompts, refs = [prompts[i] for i in order], [refs[i] for i in order]
    llm = _llm(path, num_gpu_blocks_override=78, block_size=4, max_model_len=312, enable_prefix_caching=False,
               enforce_eager=False)
    check_outputs(_generate(llm, prompts, greedy_params(max_tokens=LLAMA_NEW)), refs)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _assert_clean_pool(llm)


def test_sampling_on_the_gpu(llama):
    # seeded sampling, top-k / top-p and logprobs run on the GPU's logits: the same seed gives the same tokens
    path, prompts, _ = llama
    llm = _llm(path, num_gpu_blocks_override=256, enforce_eager=True)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=MAX_NEW, seed=7, logprobs=3,
                            ignore_eos=True)
    first, second = _generate(llm, prompts[:4], params), _generate(llm, prompts[:4], params)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert all(len(o.outputs[0].logprobs) == MAX_NEW for o in first)
    _assert_clean_pool(llm)


@pytest.mark.parametrize("kind", ["dense", "vl", "llama"])
def test_decode_graphs(checkpoints, llama, kind, monkeypatch):
    # compilation_config cudagraph_mode FULL_DECODE_ONLY: pure decode steps replay captured graphs (batch buckets 1, 2,
    # 4, 6; requests joining and finishing change the bucket), the rest runs eagerly; token for token as transformers.
    if DEVICE == "cpu":  # the same path without the capture (a CPU engine makes no graphs otherwise)
        monkeypatch.setenv(EAGER_ENV, "1")
    graphs_config = {"cudagraph_mode": "FULL_DECODE_ONLY"}
    if kind == "llama":
        path, prompts, refs = llama
        llm = _llm(path, num_gpu_blocks_override=256, compilation_config=graphs_config, max_num_seqs=6)
        check_outputs(_generate(llm, prompts, greedy_params(max_tokens=LLAMA_NEW)), refs)
        engine = llm.llm_engine
    else:
        path, prompts, refs = checkpoints(kind)
        engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(
            path, skip_tokenizer_init=True, dtype="float32", device=DEVICE, num_gpu_blocks_override=256,
            max_num_batched_tokens=40, max_num_seqs=6, compilation_config=graphs_config))
        check_outputs(generate_with_arrivals(engine, prompts, greedy_params()), refs)
        assert_pools_clean(engine)
    graphs = engine.runner.decode_graphs
    assert graphs.num_replays > 0 and graphs.graphs and (graphs.capture or DEVICE == "cpu")  # cpu: the eager stand-in
    assert all((graph is not None) == graphs.capture for graph, _ in graphs.graphs.values())


@pytest.mark.parametrize("dtype,graphs,chunked", [("float32", False, False), ("float32", True, False),
                                                  ("bfloat16", True, False), ("float32", False, True),
                                                  ("bfloat16", True, True)])
def test_qwen3_5_triton_kernels(checkpoints, monkeypatch, dtype, graphs, chunked):
    # ASCENDSERVE_TRITON_KERNELS=1: Gated DeltaNet's conv and recurrent update (decode rows and prefill sequences, the
    # prefill's delta rule token by token or chunked) and paged decode attention as Triton kernels (compiled for this
    # GPU; tests/layers checks them under the interpreter), eagerly and captured.
    if DEVICE == "cpu" and dtype == "bfloat16":
        pytest.skip("the interpreter rounds fp32 -> bf16 toward zero (a GPU to nearest): bf16 drifts past the bound")
    calls = record_triton_calls(monkeypatch)
    expected = set(TRITON_KERNELS)
    if chunked:
        monkeypatch.setenv(triton_kernels.CHUNKED_PREFILL_ENV, "1")
        expected = expected - {"gated_delta_rule_prefill"} | {CHUNKED_PREFILL_KERNEL}
    if DEVICE == "cpu":  # the interpreter (tests/conftest.py) around the torch path, the graphs' eager stand-in
        monkeypatch.setitem(cpu_kernels._state, "ops", None)
        monkeypatch.setenv(EAGER_ENV, "1")
    path, prompts, refs = checkpoints("dense" if dtype == "float32" else "dense-bf16")
    engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(
        path, skip_tokenizer_init=True, dtype=dtype, device=DEVICE, num_gpu_blocks_override=256,
        max_num_batched_tokens=40, max_num_seqs=6, enforce_eager=not graphs,
        compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"} if graphs else None))
    outputs = generate_with_arrivals(engine, prompts, greedy_params())
    if dtype == "float32":
        check_outputs(outputs, refs)
    else:  # as test_qwen3_5_bf16
        assert_near_reference(outputs, refs, max_drift=0.15, min_gap=0.5)
    assert set(calls) == expected
    assert (engine.runner.decode_graphs is not None and engine.runner.decode_graphs.num_replays > 0) == graphs
    assert_pools_clean(engine)


def _assert_clean_pool(llm):
    free, cached, in_use = llm.llm_engine.kv_cache_manager.pool.counts()
    assert in_use == 0 and free + cached == llm.llm_engine.kv_cache_manager.num_blocks


def test_server_on_the_gpu(tmp_path):
    # The real `ascendserve serve` process on CUDA, a tiny random Qwen3.5 with the Qwen3.5 tokenizer, through the
    # official client: a chat completion, a streamed one, structured outputs (the grammar masks on the device's
    # logits), and /metrics.
    tokenizer = os.environ.get(TOKENIZER_ENV)
    if not tokenizer:
        from tests.fixtures.qwen3_5_tokenizer import build_qwen3_5_tokenizer
        tokenizer = build_qwen3_5_tokenizer()
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    from tests.server.utils import RemoteServer
    config = Qwen3_5TextConfig(**{**TEXT, "vocab_size": 248320}, intermediate_size=128, tie_word_embeddings=True,
                               architectures=["Qwen3_5ForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path)
    for name in os.listdir(tokenizer):
        if not name.startswith("."):
            shutil.copy(os.path.join(tokenizer, name), tmp_path)
    server = RemoteServer([str(tmp_path), "--device", DEVICE, "--served-model-name", "tiny", "--max-model-len", "512",
                           "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser",
                           "qwen3_coder", "--api-key", "sk-ascendserve-test"])
    try:
        client = server.client()
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in ("length", "stop")
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=8, temperature=0, stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
        digits = client.completions.create(model="tiny", prompt="Number:", max_tokens=8, temperature=1.0, seed=3,
                                           extra_body={"guided_regex": "[0-9]{3}"})
        assert re.fullmatch("[0-9]{3}", digits.choices[0].text) and digits.choices[0].finish_reason == "stop"
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]
        forced = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Call f"}],
                                                tools=tools, tool_choice="required", max_tokens=48, temperature=0)
        assert forced.choices[0].finish_reason in ("tool_calls", "length")
        import httpx
        metrics = httpx.get(server.url + "/metrics").text
        assert "vllm:generation_tokens_total" in metrics
    finally:
        server.stop()
