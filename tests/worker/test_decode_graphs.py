"""Decode graphs (compilation_config cudagraph_mode FULL_DECODE_ONLY) on a CPU, without the capture itself.

ASCENDSERVE_DECODE_GRAPHS_EAGER=1 runs worker/decode_graphs.py's path with each replay run eagerly: pure decode steps
go through the static buffers, padded to the batch and block buckets, padding rows on the scratch KV block and state
slot. Against transformers token for token (requests joining and finishing, so the buckets change; slots reused),
with the C++ kernels and with the plain-torch path a GPU runs; that path reads nothing back to the host (which a
capture forbids). The capture itself runs in tests/cuda.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ascendserve import LLM
from ascendserve.config import EngineArgs
from ascendserve.engine.llm_engine import LLMEngine
from ascendserve.layers import cpu_kernels
from ascendserve.worker.decode_graphs import EAGER_ENV, capture_sizes
from tests.models.llama_tiny import LLAMA_NEW, build_llama
from tests.models.qwen3_5_tiny import assert_pools_clean, checkpoint_cache, greedy_params
from tests.models.reference import check_outputs, generate_with_arrivals

GRAPHS = {"cudagraph_mode": "FULL_DECODE_ONLY"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory)


@pytest.fixture
def eager_graphs(monkeypatch):
    monkeypatch.setenv(EAGER_ENV, "1")


def _engine(path, **kwargs) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs.from_kwargs(
        path, skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=256, max_model_len=512,
        compilation_config=GRAPHS, **kwargs))


@pytest.mark.parametrize("plain_torch", [False, True])  # the C++ ops; the torch ops a GPU runs
@pytest.mark.parametrize("max_num_seqs", [3, 6])  # slots reused by later requests; every request at once
def test_decode_steps_through_the_static_buffers_match_transformers(checkpoints, eager_graphs, monkeypatch,
                                                                    plain_torch, max_num_seqs):
    if plain_torch:
        monkeypatch.setitem(cpu_kernels._state, "ops", None)
    path, prompts, refs = checkpoints("dense")
    engine = _engine(path, max_num_batched_tokens=40, max_num_seqs=max_num_seqs)
    graphs = engine.runner.decode_graphs
    assert graphs is not None and not graphs.capture
    # the scratch block and slot lie past what the managers hand out
    assert engine.runner.kv_caches[0].shape[1] == engine.kv_cache_manager.num_blocks + 1 == graphs.scratch_block + 1
    assert engine.runner.state_caches[0][1].shape[0] == engine.state_cache_manager.num_slots + 1
    prepare, prepared = engine.runner.prepare, []
    monkeypatch.setattr(engine.runner, "prepare", lambda sched: prepared.append(prepare(sched)) or prepared[-1])
    check_outputs(generate_with_arrivals(engine, prompts, greedy_params()), refs)
    assert graphs.num_replays > 0 and len({rows for rows, _ in graphs.graphs}) >= 2, graphs.graphs
    # a step a graph takes gets no eager positions or metadata (its buffers hold them); every other step does
    planned = [step for step in prepared if step.graph_plan is not None]
    assert len(planned) == graphs.num_replays < len(prepared)
    assert all(step.positions is None and step.attn_meta is None and step.state_meta is None for step in planned)
    assert all(step.positions is not None and step.attn_meta is not None and step.state_meta is not None
               for step in prepared if step.graph_plan is None)
    assert_pools_clean(engine)


def test_llama_decode_graphs_match_transformers(eager_graphs, tmp_path):
    path, prompts, refs = build_llama(tmp_path)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=256, max_model_len=512,
              compilation_config=GRAPHS, max_num_seqs=4)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(max_tokens=LLAMA_NEW), use_tqdm=False)
    check_outputs(outputs, refs)
    assert llm.llm_engine.runner.decode_graphs.num_replays > 0


class _HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's value back to the host, or copy a host value in (both fail in a capture)."""

    NAMES = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "lift_fresh", "tolist"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.NAMES:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["dense", "vl"])
def test_the_captured_forward_reads_nothing_back(checkpoints, eager_graphs, monkeypatch, kind):
    monkeypatch.setitem(cpu_kernels._state, "ops", None)  # the plain-torch path, as on a GPU
    path, prompts, _ = checkpoints(kind)
    engine = _engine(path, max_num_seqs=4)
    graphs = engine.runner.decode_graphs
    graphs._fill_scratch(4, 8)
    with torch.inference_mode(), _HostReads() as reads:
        out = graphs._forward(4, 8)
    assert out.shape == (4, engine.config.hf_config.get_text_config().hidden_size) and not reads.seen, reads.seen


def test_moe_and_enforce_eager_and_cpu_keep_decode_eager(checkpoints, monkeypatch, caplog):
    path, _, _ = checkpoints("dense")
    with caplog.at_level("WARNING", logger="ascendserve"):
        assert _engine(path).runner.decode_graphs is None  # a CPU without the eager stand-in: no graphs
    assert "graphs need a CUDA device; on cpu decode steps run eagerly" in caplog.text
    monkeypatch.setenv(EAGER_ENV, "1")
    assert _engine(path, enforce_eager=True).runner.decode_graphs is None
    moe, _, _ = checkpoints("moe")
    with caplog.at_level("WARNING", logger="ascendserve"):
        engine = _engine(moe)
    assert engine.runner.decode_graphs is None and "expert routing" in caplog.text
    assert engine.runner.kv_caches[0].shape[1] == engine.kv_cache_manager.num_blocks  # no scratch block then


def test_capture_sizes_and_buckets():
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256
    assert capture_sizes(6) == [1, 2, 4, 6] and capture_sizes(12, [1, 3, 64]) == [1, 3, 12]


@pytest.mark.parametrize("config,message", [
    ("FULL", "compilation_config must be a JSON object"),
    ({"cudagraph_mode": "SOMETIMES"}, "cudagraph_mode must be one of"),
    ({"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [0, 8]}, "cudagraph_capture_sizes must be a list"),
])
def test_bad_compilation_config_is_a_clear_error(config, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs.from_kwargs("x", compilation_config=config)
