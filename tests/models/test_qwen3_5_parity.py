"""Qwen3.5 (dense, MoE, composite VL checkpoint) against transformers on tiny random checkpoints.

Every engine path that touches the recurrent state is exercised: chunked prefill with budgets that
do and do not align with the delta rule's 64-token chunks, recompute preemption into a fresh state
slot, and requests joining while others decode (with few slots, so slots are reused).
"""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, apply_rotary_pos_emb

from ascendserve import LLM
from ascendserve.config import EngineArgs
from ascendserve.engine.llm_engine import LLMEngine
from ascendserve.layers import cpu_kernels
from ascendserve.layers.compact_linear import Bf16Embedding, Bf16Linear
from ascendserve.layers.linear import DenseLinear, PackedLinear, PanelLinear
from ascendserve.layers.mrope import MRotaryEmbedding, interleaved_axis_of_slots
from ascendserve.models import qwen3_5
from ascendserve.worker.kv_budget import KVCacheTooSmallError
from ascendserve.worker.model_runner import build_state_metadata
from tests.models.qwen3_5_tiny import (LENGTHS, MOE, ROPE, TEXT, VOCAB, assert_near_reference, assert_pools_clean,
                                       checkpoint_cache, greedy_params)
from tests.models.reference import check_outputs, generate_with_arrivals

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (path, prompts, transformers references), each built on first use."""
    return checkpoint_cache(tmp_path_factory)


def _llm(path, **engine_args):
    return LLM(path, skip_tokenizer_init=True, dtype="float32", **engine_args)


@pytest.mark.parametrize("kind,budget,enforce_eager", [("dense", 16, True), ("dense", 48, True), ("dense", 100, True),
                                                       ("dense", 100, False), ("moe", 48, False), ("vl", 100, True)])
def test_chunked_prefill(checkpoints, kind, budget, enforce_eager, monkeypatch):
    monkeypatch.setenv("ASCENDSERVE_COMPILE", "1")  # compiled unless enforce_eager, whatever the default
    path, prompts, refs = checkpoints(kind)
    # Prefix caching is asked for but must be off: a hybrid model cannot reuse KV blocks alone.
    llm = _llm(path, num_gpu_blocks_override=256, max_num_batched_tokens=budget, enable_prefix_caching=True,
               enforce_eager=enforce_eager)
    assert not llm.llm_engine.config.enable_prefix_caching
    assert not llm.llm_engine.kv_cache_manager.enable_caching
    check_outputs(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(), use_tqdm=False), refs)
    assert_pools_clean(llm.llm_engine)


@pytest.mark.parametrize("budget", [100, 1024])  # the kernel on every step; prefill steps above its row limit
def test_bf16_checkpoint_runs_in_fp32_from_bf16_weights(checkpoints, budget):
    # A bf16 checkpoint run in fp32 keeps its linear weights as bf16 (exact) and multiplies in fp32 with
    # the CPU kernel: the same numbers as transformers' fp32 model of the bf16 values.
    path, prompts, refs = checkpoints("dense-bf16")
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    llm = _llm(path, num_gpu_blocks_override=256, max_num_batched_tokens=budget)
    model = llm.llm_engine.runner.model
    kinds = (nn.Linear, Bf16Linear, DenseLinear, PackedLinear, PanelLinear)
    linears = [m for m in model.modules() if isinstance(m, kinds)]
    assert linears and all(isinstance(m, Bf16Linear) for m in linears), {type(m).__name__ for m in linears}
    # tied, and the lm_head now bf16 panels of its own: the fp32 table is freed
    assert isinstance(model.model.embed_tokens, Bf16Embedding)
    check_outputs(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(), use_tqdm=False), refs)
    assert_pools_clean(llm.llm_engine)


@pytest.mark.parametrize("budget", [48, 1024])  # chunked prefill (prefill continues from the slot); whole prompts
def test_bf16_model_runs_gated_deltanet_on_the_fp32_ops(checkpoints, budget, monkeypatch):
    # --dtype bfloat16 on CPU (what --dtype auto picks with AMX): the linears on Bf16Linear.for_bf16 (AMX / vdpbf16ps),
    # the Gated DeltaNet layers on the fused C++ ops, which compute in fp32 from widened projections and an fp32 conv
    # pool; against transformers' fp32 model of the same bf16 weights, bf16 activations rounding at every layer. This
    # tiny random model is sharp: transformers' own bf16 run of it leaves its fp32 greedy path where the top two are
    # 0.29 apart and its logprobs drift by 0.11 before that (ours: 0.07), so tokens may part below a 0.5 gap.
    path, prompts, refs = checkpoints("dense-bf16")
    calls = []
    recording = _RecordingGdnOps(cpu_kernels.ops(), calls)
    llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", num_gpu_blocks_override=256,
              max_num_batched_tokens=budget)
    runner = llm.llm_engine.runner
    assert all(conv.dtype == torch.float32 and ssm.dtype == torch.float32 for conv, ssm in runner.state_caches)
    gdn = [m for m in runner.model.modules() if hasattr(m, "fp32_output_linears")]
    # the projections the fp32 ops read keep their fp32 sums; out_proj rounds as every other bf16 layer
    assert gdn and all(m.in_proj_qkvz.fp32_out and m.in_proj_ba.fp32_out and not m.out_proj.fp32_out for m in gdn)
    monkeypatch.setitem(cpu_kernels._state, "ops", recording)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(), use_tqdm=False)
    assert {"gdn_decode", "gdn_prefill"} <= set(calls)
    assert_near_reference(outputs, refs, max_drift=0.1, min_gap=0.5)
    assert_pools_clean(llm.llm_engine)


class _RecordingGdnOps:
    """The real CPU ops, noting each Gated DeltaNet op called in `calls`."""

    def __init__(self, real, calls: list) -> None:
        self._real, self._calls = real, calls

    def __getattr__(self, name):
        op = getattr(self._real, name)
        return (lambda *a: self._calls.append(name) or op(*a)) if name.startswith("gdn_") else op


@pytest.mark.parametrize("fused", [True, False])  # the C++ ops, or the plain-torch path other devices run
@pytest.mark.parametrize("budget", [48, 1024])  # chunked prefill (rounds the state at every chunk); whole prompts
def test_bf16_recurrent_state(checkpoints, fused, budget, monkeypatch, caplog):
    # --mamba-ssm-cache-dtype bfloat16 on an fp32 model: half the state pool, the recurrent state rounded to bf16 as
    # it is stored; against transformers' fp32 model, which keeps fp32 state.
    path, prompts, refs = checkpoints("dense")
    fp32 = _llm(path, num_gpu_blocks_override=256, max_num_batched_tokens=budget).llm_engine.runner.state_caches
    calls = []
    monkeypatch.setitem(cpu_kernels._state, "ops", _RecordingGdnOps(cpu_kernels.ops(), calls) if fused else None)
    with caplog.at_level("INFO", logger="ascendserve"):
        llm = _llm(path, num_gpu_blocks_override=256, max_num_batched_tokens=budget, mamba_ssm_cache_dtype="bfloat16")
    assert "Recurrent (Gated DeltaNet) states in bfloat16, not the checkpoint's float32" in caplog.text
    assert "recurrent states in torch.bfloat16" in caplog.text  # the cache plan's line
    pools = llm.llm_engine.runner.state_caches
    assert all(conv.dtype == torch.float32 and ssm.dtype == torch.bfloat16 for conv, ssm in pools)
    assert pools[0][1].shape == fp32[0][1].shape
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(), use_tqdm=False)
    assert ({"gdn_decode", "gdn_prefill"} <= set(calls)) == fused
    assert_near_reference(outputs, refs, max_drift=0.1, min_gap=0.5)
    assert_pools_clean(llm.llm_engine)


def test_plain_torch_decode_path(checkpoints, monkeypatch):
    # Without the CPU kernels (other devices, ASCENDSERVE_CPU_KERNELS=0) a decode step runs Gated DeltaNet
    # as plain-torch ops instead of the fused op, and attention gathers its blocks.
    monkeypatch.setitem(cpu_kernels._state, "ops", None)
    path, prompts, refs = checkpoints("dense")
    llm = _llm(path, num_gpu_blocks_override=256, max_num_batched_tokens=100)
    check_outputs(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(), use_tqdm=False), refs)
    assert_pools_clean(llm.llm_engine)


@pytest.mark.parametrize("kind,async_scheduling", [("dense", False), ("dense", True), ("moe", False), ("vl", False)])
def test_preemption(checkpoints, kind, async_scheduling):
    path, prompts, refs = checkpoints(kind)
    order = [LENGTHS.index(n) for n in (300, 7, 1, 130, 65, 64)]
    prompts, refs = [prompts[i] for i in order], [refs[i] for i in order]
    # 78 blocks of 4 tokens: the prompts of 300, 7 and 1 tokens fill them all, so once the longest
    # request decodes, the newest ones are preempted, recomputed from token 0 into a fresh state
    # slot, and must still match.
    llm = _llm(path, num_gpu_blocks_override=78, block_size=4, max_model_len=312, async_scheduling=async_scheduling)
    check_outputs(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(), use_tqdm=False), refs)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_pools_clean(llm.llm_engine)


@pytest.mark.parametrize("kind,async_scheduling", [("dense", False), ("dense", True), ("vl", False)])
def test_requests_join_while_others_decode(checkpoints, kind, async_scheduling):
    path, prompts, refs = checkpoints(kind)
    # 3 state slots for 6 requests: later requests reuse slots that earlier ones wrote.
    engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(
        path, skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=256,
        max_num_batched_tokens=40, max_num_seqs=3, async_scheduling=async_scheduling))
    outputs = generate_with_arrivals(engine, prompts, greedy_params())
    assert engine.state_cache_manager.num_slots == 3
    check_outputs(outputs, refs)
    assert_pools_clean(engine)


def test_moe_per_expert_and_fused_layouts(checkpoints, tmp_path):
    path, prompts, refs = checkpoints("moe")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert any(re.search(r"\.experts\.\d+\.gate_proj\.weight$", n) for n in tensors)  # transformers saves per expert
    fused = _fuse_experts(tensors, MOE["num_experts"])
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(path, "config.json"), tmp_path / "config.json")
    for source in (path, str(tmp_path)):
        llm = _llm(source, num_gpu_blocks_override=256)
        check_outputs(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(), use_tqdm=False), refs)


def _fuse_experts(tensors: dict, num_experts: int) -> dict:
    """Per-expert tensors -> the released BF16 layout: experts.gate_up_proj [E, 2I, H], experts.down_proj."""
    out, prefixes = {}, set()
    for name, tensor in tensors.items():
        match = re.match(r"(.*\.experts)\.\d+\.", name)
        if match:
            prefixes.add(match[1])
        else:
            out[name] = tensor
    for p in prefixes:
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}.{e}.gate_proj.weight"],
                                                           tensors[f"{p}.{e}.up_proj.weight"]])
                                                for e in range(num_experts)]).contiguous()
        out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"]
                                             for e in range(num_experts)]).contiguous()
    return out


def test_state_pool_that_does_not_fit_is_a_clear_error(checkpoints):
    path, _, _ = checkpoints("dense")
    # 3 layers x (conv 128 x 3 + recurrent 4 x 16 x 16) x 4 bytes = 16896 bytes per slot
    expected = r"state pool of 256 slots \(max_num_seqs\) x 16896 bytes needs 4.12 MiB, more than .* 1.00 MiB"
    with pytest.raises(KVCacheTooSmallError, match=expected):
        _llm(path, kv_cache_memory_bytes=1 << 20, max_num_seqs=256)


def test_default_max_num_seqs_leaves_half_the_budget_to_kv_blocks(checkpoints):
    path, _, _ = checkpoints("dense")
    engine = _llm(path, kv_cache_memory_bytes=1 << 20, max_model_len=128).llm_engine
    assert engine.config.max_num_seqs == (1 << 20) // 2 // 16896 == 31
    assert engine.state_cache_manager.num_slots == 31 and engine.scheduler.max_num_seqs == 31


def test_mrope_matches_transformers():
    config = Qwen3_5TextConfig(**{**TEXT, "head_dim": 64, "rope_parameters": {**ROPE, "mrope_section": [3, 3, 2]}})
    hf = Qwen3_5TextRotaryEmbedding(config)
    positions = torch.randint(0, 500, (3, 1, 37))  # distinct (t, h, w) rows, as for image tokens
    q, k = torch.randn(1, 4, 37, 64), torch.randn(1, 2, 37, 64)
    cos, sin = hf(q, positions)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    ours = MRotaryEmbedding(hf.inv_freq, 1.0, 512, [3, 3, 2])
    q_out, k_out = ours(positions[:, 0], q[0].transpose(0, 1), k[0].transpose(0, 1))
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1))
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1))


def test_mrope_slot_owners_of_released_configs():
    owners = "".join("THW"[a] for a in interleaved_axis_of_slots(32, [11, 11, 10]).tolist())
    assert owners == "THW" * 10 + "TH"


def test_composite_checkpoint_loads_its_text_model(checkpoints, caplog):
    path, _, _ = checkpoints("vl")
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    with caplog.at_level("INFO", logger="ascendserve"):
        engine = _llm(path, num_gpu_blocks_override=64).llm_engine
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Skipped")]
    assert len(skipped) == 1 and "model.visual.*" in skipped[0]
    assert engine.vocab_size == VOCAB and engine.runner.state_caches is not None


@pytest.mark.parametrize("query_lens, starts", [([1, 1, 5, 3], [9, 4, 0, 64]), ([5, 1, 3, 1], [0, 9, 64, 4])])
def test_mixed_steps_give_each_kind_its_rows(query_lens, starts):
    """Decodes first: row slices (views of the step's tensors); else gathered rows; either way each row's result lands
    in its own row."""
    meta = build_state_metadata(query_lens, starts, [0, 1, 2, 3], torch.device("cpu"))
    x = torch.arange(sum(query_lens) * 2, dtype=torch.float32).view(-1, 2)
    seen = {}

    def kind(name, sign):
        def run(rows):
            (taken,) = qwen3_5._take(rows, x)
            seen[name] = (rows, taken)
            return sign * taken
        return run

    out = qwen3_5._by_kind(meta, torch.empty_like(x), kind("decode", -1), kind("prefill", 1))
    decode_rows = meta.decode_token_idx.tolist()
    assert torch.equal(out, torch.stack([-r if i in decode_rows else r for i, r in enumerate(x)]))
    if query_lens[0] == 1:
        assert isinstance(seen["decode"][0], slice) and seen["prefill"][1].data_ptr() == x[2].data_ptr()  # a view
    else:
        assert torch.is_tensor(seen["decode"][0]) and seen["decode"][0].tolist() == [5, 9]


def test_state_metadata_splits_decodes_from_prefills():
    meta = build_state_metadata([1, 5, 3], [9, 0, 64], [2, 0, 1], torch.device("cpu"))
    assert meta.decode_token_idx.tolist() == [0] and meta.decode_slots.tolist() == [2]
    assert meta.prefill_token_idx.tolist() == list(range(1, 9))
    assert meta.prefill_cu_seqlens.tolist() == [0, 5, 8] and meta.prefill_slots.tolist() == [0, 1]
    assert meta.prefill_has_initial_state.tolist() == [False, True]
    assert meta.split_row == 1  # the decode first, the prefills after it: row slices
    assert build_state_metadata([5, 1, 3], [0, 9, 64], [0, 2, 1], torch.device("cpu")).split_row is None
    # a 1-token prompt starts a state: chunked path; all rows are prefill rows, in order
    meta = build_state_metadata([1, 4], [0, 8], [3, 1], torch.device("cpu"))
    assert meta.decode_token_idx is None and meta.prefill_token_idx is None
    assert meta.prefill_cu_seqlens.tolist() == [0, 1, 5] and meta.prefill_has_initial_state.tolist() == [False, True]
    # decodes in slots 5, 3, 4: a block starting at 3, rows in slot order 1, 2, 0
    meta = build_state_metadata([1, 1, 1], [7, 9, 4], [5, 3, 4], torch.device("cpu"))
    assert meta.decode_slot_block[0] == 3 and meta.decode_slot_block[1].tolist() == [1, 2, 0]
    assert build_state_metadata([1, 1], [7, 9], [0, 1], torch.device("cpu")).decode_slot_block == (0, None)
    assert build_state_metadata([1, 1], [7, 9], [0, 2], torch.device("cpu")).decode_slot_block is None
