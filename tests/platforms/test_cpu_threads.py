"""vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND: the model thread and its OpenMP threads on the cores it lists."""
import os

import pytest
import torch

from ascendserve import LLM, SamplingParams
from ascendserve.platforms.cpu import omp_threads_bind
from tests.models.llama_tiny import build_llama


@pytest.fixture
def restore_threads():
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    yield affinity
    torch.set_num_threads(threads)  # torch's count is process-wide: the other tests keep both cores
    os.sched_setaffinity(0, affinity)


@pytest.mark.parametrize("value, cpus", [(None, None), ("auto", None), ("nobind", None), ("0", [0]), ("0-0", [0]),
                                         ("0|1", [0])])
def test_the_list_is_read_as_vllm_writes_it(monkeypatch, value, cpus):
    if value is None:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", value)
    assert omp_threads_bind() == cpus


@pytest.mark.parametrize("value, message", [("0-", "must list cores such as 0-31"), ("x", "must list cores"),
                                            ("0,4096", "names cores [4096] this process may not run on")])
def test_a_bad_list_is_named(monkeypatch, value, message):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", value)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        omp_threads_bind()


def test_the_model_thread_runs_on_the_listed_cores(tmp_path, monkeypatch, restore_threads):
    path = build_llama(tmp_path)[0]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=32)
    engine = llm.llm_engine
    seen = engine._model_thread.submit(lambda: (os.sched_getaffinity(0), torch.get_num_threads())).result()
    assert seen == ({0}, 1)
    assert os.sched_getaffinity(0) == restore_threads  # the calling thread (the API server's) is not pinned
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
