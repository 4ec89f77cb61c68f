"""The Triton kernels (layers/triton_ops.py) against the plain-torch forms they replace, and a tiny Qwen3.5
run through the engine on them against transformers.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) on
CPU tensors: that checks their indexing, masks, roundings and arithmetic, not their compilation for a GPU or their
speed (tests/cuda runs on a GPU with ASCENDSERVE_TRITON_KERNELS=1 for those).
"""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ascendserve.layers import cpu_kernels, triton_kernels
from ascendserve.layers.gated_deltanet import (causal_conv1d_decode, causal_conv1d_prefill, chunk_gated_delta_rule,
                                               recurrent_gated_delta_rule)
from ascendserve.worker.decode_graphs import EAGER_ENV
from tests.models.qwen3_5_tiny import (CHUNKED_PREFILL_KERNEL, TRITON_KERNELS, assert_pools_clean, checkpoint_cache,
                                       greedy_params, record_triton_calls)
from tests.models.reference import check_outputs, generate_with_arrivals

pytest.importorskip("triton", reason="triton is a test dependency (pyproject's [test] extra)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Where a bf16 rounding happens on the way: the interpreter rounds fp32 -> bf16 toward zero (a GPU to nearest), so a
# value may sit a bf16 ulp (2^-8 relative) from the torch form's; a wrong index or mask is off by far more.
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def kernels():
    """layers.triton_ops; without a GPU under the interpreter, which tests/conftest.py turned on."""
    assert DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return importlib.import_module("ascendserve.layers.triton_ops")


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


SLOTS = [5, 0, 7, 2, 3]  # rows write scattered slots of an 8-slot pool; the others must stay as they were


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv1d_decode_matches_torch(kernels, dtype, activation):
    channels, width = 200, 4  # 200: a partial channel block
    wide = _randn(len(SLOTS), channels + 24, seed=0, dtype=dtype)
    x = wide[:, 8:8 + channels]  # strided rows, as the split of in_proj_qkvz gives
    weight = _randn(channels, width, seed=1, dtype=dtype, scale=0.5)
    pool = _randn(8, channels, width - 1, seed=2, dtype=dtype)
    slots = torch.tensor(SLOTS, device=DEVICE)
    ref_pool = pool.clone()
    ref = causal_conv1d_decode(x, weight, ref_pool, slots, activation=activation)
    out = kernels.causal_conv1d_decode(x, weight, pool, slots, activation)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL))
    assert torch.equal(pool, ref_pool)  # the shifted window and every untouched slot, bit for bit


def test_conv1d_decode_rejects_other_activations(kernels):
    x = torch.zeros(1, 4, device=DEVICE)
    with pytest.raises(ValueError, match="unsupported conv activation 'gelu'"):
        kernels.causal_conv1d_decode(x, torch.zeros(4, 4, device=DEVICE), torch.zeros(1, 4, 3, device=DEVICE),
                                     torch.zeros(1, dtype=torch.long, device=DEVICE), "gelu")


def _gates(ba, a_log, dt_bias, num_v_heads):
    """Qwen3_5GatedDeltaNet._gates: (g, beta) as the torch path computes them."""
    b, a = ba.split([num_v_heads, num_v_heads], dim=-1)
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 32, 16), (1, 3, 24, 40), (2, 2, 16, 64)])  # grouped heads, dk != dv,
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32),  # widths off powers of two, several
                                               (torch.bfloat16, torch.float32),  # value-column blocks
                                               (torch.bfloat16, torch.bfloat16)])
def test_gated_delta_rule_decode_matches_torch(kernels, hk, hv, dk, dv, dtype, state_dtype):
    batch, key_dim = len(SLOTS), hk * dk
    conv_out = _randn(batch, 2 * key_dim + hv * dv + 8, seed=3, dtype=dtype)[:, :2 * key_dim + hv * dv]  # strided
    ba = _randn(batch, 2 * hv, seed=4, dtype=dtype)
    ba[0, hv] = 30.0  # a > 20: softplus's linear branch
    a_log = _randn(hv, seed=5, dtype=dtype, scale=0.5)
    dt_bias = _randn(hv, seed=6, dtype=dtype)
    pool = _randn(8, hv, dk, dv, seed=7, scale=0.5).to(state_dtype)
    slots = torch.tensor(SLOTS, device=DEVICE)
    ref_pool = pool.clone()
    q, k, v = conv_out.split([key_dim, key_dim, hv * dv], dim=-1)
    ref = recurrent_gated_delta_rule(q.reshape(batch, hk, dk), k.reshape(batch, hk, dk), v.reshape(batch, hv, dv),
                                     *_gates(ba, a_log, dt_bias, hv), ref_pool, slots, use_qk_l2norm_in_kernel=True)
    out = kernels.gated_delta_rule_decode(conv_out, ba, a_log, dt_bias, pool, slots, hk, dk, dv)
    assert out.dtype == dtype and out.shape == (batch, hv, dv)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == state_dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(pool.float(), ref_pool.float(), **tol)
    untouched = [s for s in range(8) if s not in SLOTS]
    assert torch.equal(pool[untouched], ref_pool[untouched])


PREFILL_LENS = [5, 1, 70, 2, 33]  # shorter than the conv's window, longer than a delta-rule chunk (64)
PREFILL_INITIAL = [True, False, True, True, False]  # fresh sequences read zeros whatever their slot holds


def _prefill_meta():
    cu = torch.tensor([0, *torch.tensor(PREFILL_LENS).cumsum(0).tolist()], device=DEVICE)
    return (cu, torch.tensor(SLOTS, device=DEVICE), torch.tensor(PREFILL_INITIAL, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv1d_prefill_matches_torch(kernels, dtype):
    channels, tokens = 200, sum(PREFILL_LENS)
    x = _randn(tokens, channels + 24, seed=11, dtype=dtype)[:, 8:8 + channels]
    weight = _randn(channels, 4, seed=12, dtype=dtype, scale=0.5)
    pool = _randn(8, channels, 3, seed=13, dtype=dtype)
    cu, slots, initial = _prefill_meta()
    ref_pool = pool.clone()
    ref = causal_conv1d_prefill(x, weight, ref_pool, cu, slots, initial)
    out = kernels.causal_conv1d_prefill(x, weight, pool, cu, slots, initial, "silu")
    torch.testing.assert_close(out, ref, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL))
    assert torch.equal(pool, ref_pool)  # the last three inputs (or the old context's tail), every other slot as it was
    with pytest.raises(ValueError, match="a width-4 conv only"):
        kernels.causal_conv1d_prefill(x, weight[:, :3], pool, cu, slots, initial, "silu")


@pytest.mark.parametrize("form", ["gated_delta_rule_prefill", "chunk_gated_delta_rule"])  # token by token, chunked
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 32, 16), (1, 3, 24, 40)])
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_gated_delta_rule_prefill_matches_the_chunked_form(kernels, form, hk, hv, dk, dv, dtype, state_dtype):
    tokens, key_dim = sum(PREFILL_LENS), hk * dk
    conv_out = _randn(tokens, 2 * key_dim + hv * dv + 8, seed=14, dtype=dtype)[:, :2 * key_dim + hv * dv]
    ba = _randn(tokens, 2 * hv, seed=15, dtype=dtype)
    a_log = _randn(hv, seed=16, dtype=dtype, scale=0.5)
    dt_bias = _randn(hv, seed=17, dtype=dtype)
    pool = _randn(8, hv, dk, dv, seed=18, scale=0.5).to(state_dtype)
    cu, slots, initial = _prefill_meta()
    ref_pool = pool.clone()
    q, k, v = conv_out.split([key_dim, key_dim, hv * dv], dim=-1)
    start = torch.where(initial[:, None, None, None], ref_pool[slots], 0.0)  # as Qwen3_5GatedDeltaNet._prefill
    ref, final = chunk_gated_delta_rule(q.reshape(tokens, hk, dk), k.reshape(tokens, hk, dk),
                                        v.reshape(tokens, hv, dv), *_gates(ba, a_log, dt_bias, hv), start, cu, 64,
                                        use_qk_l2norm_in_kernel=True)
    ref_pool[slots] = final.to(state_dtype)
    out = getattr(kernels, form)(conv_out, ba, a_log, dt_bias, pool, cu, slots, initial, hk, dk, dv)
    assert out.dtype == dtype and out.shape == (tokens, hv, dv)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else BF16_TOL  # token by token vs chunked: fp32 order
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(pool, ref_pool, **tol)


def test_bf16_chunked_products_stay_near_the_fp32_recurrence(kernels):
    # A bf16 model's chunked prefill multiplies bf16 operands (FLA's precision, triton_ops.delta_dot); the token-by-
    # token kernel keeps fp32 products. Over 5 chunks at Qwen3.5's dk = 128 the two stay within a few bf16 ulps of
    # the output (measured 1.1% of its largest value) and ~1% of the carried state (1.2%); an indexing slip is far off.
    torch.manual_seed(0)
    hk, hv, dk, dv, lens = 1, 2, 128, 64, [260, 70]
    tokens = sum(lens)
    x = torch.randn(tokens, 2 * hk * dk + hv * dv, device=DEVICE).bfloat16()
    ba = torch.randn(tokens, 2 * hv, device=DEVICE).bfloat16()
    a_log, dt_bias = (torch.randn(hv, device=DEVICE) * 0.5).bfloat16(), torch.randn(hv, device=DEVICE).bfloat16()
    pool = torch.randn(2, hv, dk, dv, device=DEVICE) * 0.5
    meta = (torch.tensor([0, lens[0], tokens], device=DEVICE), torch.tensor([0, 1], device=DEVICE),
            torch.tensor([True, False], device=DEVICE))
    (token, token_pool), (chunked, chunked_pool) = (
        (getattr(kernels, form)(x, ba, a_log, dt_bias, p, *meta, hk, dk, dv).float(), p)
        for form, p in (("gated_delta_rule_prefill", pool.clone()), ("chunk_gated_delta_rule", pool.clone())))
    out_error = float((chunked - token).abs().max() / token.abs().max())
    state_error = float((chunked_pool - token_pool).abs().max() / token_pool.abs().max())
    print(f"bf16 chunked vs fp32 token by token, of the largest value: output {out_error:.4f}, state {state_error:.4f}")
    assert out_error <= 0.03 and state_error <= 0.03


def test_delta_rule_kernels_reject_a_strided_state_pool(kernels):
    # the kernels address a slot's [Hv, dk, dv] as contiguous: a pool laid out otherwise is an error, not garbage
    x, ba = torch.zeros(1, 2 * 32 + 2 * 16, device=DEVICE), torch.zeros(1, 4, device=DEVICE)
    pool = torch.zeros(2, 2, 16, 32, device=DEVICE).transpose(2, 3)  # [slots, Hv, dk 32, dv 16], dk and dv swapped
    slots, params = torch.zeros(1, dtype=torch.long, device=DEVICE), torch.zeros(2, device=DEVICE)
    with pytest.raises(ValueError, match="gated_delta_rule_decode: .* each state slot contiguous"):
        kernels.gated_delta_rule_decode(x, ba, params, params, pool, slots, 1, 32, 16)
    for form in ("gated_delta_rule_prefill", "chunk_gated_delta_rule"):
        with pytest.raises(ValueError, match=f"^{form}: .* each state slot contiguous"):
            getattr(kernels, form)(x, ba, params, params, pool, torch.tensor([0, 1], device=DEVICE), slots,
                                   torch.ones(1, dtype=torch.bool, device=DEVICE), 1, 32, 16)


def _paged_reference(q, kv_cache, tables, context_lens, scale):
    """Softmax attention of each request's one query over its blocks, in float64."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, n in enumerate(context_lens.tolist()):
        pos = torch.arange(n)
        slots = tables[i].cpu()[pos // block_size] * block_size + pos % block_size
        k, v = (kv_cache[j].cpu().flatten(0, 1)[slots].double() for j in (0, 1))  # [n, Hk, D]
        group = q.shape[1] // num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        probs = torch.einsum("hd,nhd->hn", q[i].cpu().double(), k).mul(scale).softmax(-1)
        out[i] = torch.einsum("hn,nhd->hd", probs, v)
    return out


@pytest.mark.parametrize("hq,hk,head_dim,block_size", [(8, 2, 64, 16), (4, 4, 32, 32), (16, 2, 256, 16)])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("splits", [1, 3])  # 3: parts of 2 blocks, the last past every context, the second past some
def test_paged_decode_matches_softmax_attention(kernels, hq, hk, head_dim, block_size, dtype, cache_dtype, splits):
    context_lens = [1, block_size, block_size + 1, 3 * block_size - 5]  # a lone token, whole and partial blocks
    num_blocks = 24
    kv_cache = _randn(2, num_blocks, block_size, hk, head_dim, seed=8, dtype=cache_dtype)
    gen = torch.Generator().manual_seed(9)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(context_lens), 4, dtype=torch.long)  # unused entries: block 0, as the runner pads
    used = 0
    for i, n in enumerate(context_lens):
        count = -(-n // block_size)
        tables[i, :count] = order[used:used + count]
        used += count
    q = _randn(len(context_lens), hq, head_dim, seed=10, dtype=dtype)
    lens = torch.tensor(context_lens, device=DEVICE)
    scale = head_dim ** -0.5
    out = kernels.paged_decode(q, kv_cache, tables.to(DEVICE), lens, scale, splits=splits)
    ref = _paged_reference(q, kv_cache, tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.cpu().double(), ref, **tol)


def test_paged_decode_splits_long_contexts_of_few_requests(kernels):
    # the interpreter's "GPU" takes 4 programs: 1 request x 2 kv heads gets 2 parts of >= 8 blocks where it has them
    cpu = torch.device("cpu")
    assert kernels.num_splits(1, 2, 20, cpu) == 2 and kernels.num_splits(1, 2, 8, cpu) == 1
    assert kernels.num_splits(1, 1, 64, cpu) == 4 and kernels.num_splits(2, 2, 64, cpu) == 1


def test_paged_decode_takes_power_of_two_blocks_of_16_or_more(kernels):
    assert kernels.supports_paged_decode(16, 64) and kernels.supports_paged_decode(128, 256)
    assert not kernels.supports_paged_decode(8, 64) and not kernels.supports_paged_decode(24, 64)
    with pytest.raises(ValueError, match="block_size 8 must be a power of two >= 16"):
        kernels.paged_decode(torch.zeros(1, 2, 32, device=DEVICE), torch.zeros(2, 4, 8, 2, 32, device=DEVICE),
                             torch.zeros(1, 1, dtype=torch.long, device=DEVICE),
                             torch.ones(1, dtype=torch.long, device=DEVICE), 1.0)


def test_switch_is_off_by_default_and_needs_a_triton_device(kernels, monkeypatch, caplog):
    t = torch.zeros(1)
    monkeypatch.setattr(triton_kernels, "_state", {"ops": kernels})  # nothing said yet in this process
    monkeypatch.delenv(triton_kernels.ENV_VAR, raising=False)
    assert triton_kernels.ops_for(t) is None
    monkeypatch.setenv(triton_kernels.ENV_VAR, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with caplog.at_level("INFO", logger="ascendserve.layers.triton_kernels"):
        assert triton_kernels.ops_for(t) is None and triton_kernels.ops_for(t) is None  # CPU, outside the interpreter
    said = [r.getMessage() for r in caplog.records if "applies to CUDA devices" in r.getMessage()]
    assert said == ["ASCENDSERVE_TRITON_KERNELS=1 applies to CUDA devices: on cpu the layers keep their own kernels"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_kernels.ops_for(t) is kernels


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory)


# eager steps, each context read in up to 3 parts, prefills on the chunked delta rule; decode steps through the graphs'
# static buffers, parts as the heuristic picks them (mostly one at these batches), prefills token by token
@pytest.mark.parametrize("graphs", [False, True])
def test_qwen3_5_on_the_triton_kernels_matches_transformers(kernels, checkpoints, monkeypatch, graphs):
    from ascendserve import LLM
    calls = record_triton_calls(monkeypatch)
    expected = set(TRITON_KERNELS)
    if not graphs:
        monkeypatch.setenv(triton_kernels.CHUNKED_PREFILL_ENV, "1")
        expected = expected - {"gated_delta_rule_prefill"} | {CHUNKED_PREFILL_KERNEL}
    monkeypatch.setitem(cpu_kernels._state, "ops", None)  # the plain-torch path a GPU takes, around the kernels
    extra = {}
    if not graphs:
        monkeypatch.setattr(kernels, "num_splits", lambda batch, heads, max_blocks, device: min(3, max_blocks))
    else:
        monkeypatch.setenv(EAGER_ENV, "1")
        extra = dict(compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}, max_model_len=512)
    path, prompts, refs = checkpoints("dense")
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", device=DEVICE, num_gpu_blocks_override=256,
              max_num_batched_tokens=40, max_num_seqs=4, **extra)
    # requests join while others decode: steps that mix prefill and decode rows, and pure decode steps
    check_outputs(generate_with_arrivals(llm.llm_engine, prompts, greedy_params()), refs)
    assert set(calls) == expected
    if graphs:
        assert llm.llm_engine.runner.decode_graphs.num_replays > 0
    assert_pools_clean(llm.llm_engine)


def test_kernels_compile_for_ampere_and_hopper(tmp_path):
    # Triton's compiler and ptxas (both in the triton wheel) build each kernel for sm_80 and sm_90 at Qwen3.5-0.8B's
    # and -27B's shapes in the dtypes it meets, as a GPU's first launch would: what the interpreter cannot show (a
    # construct the GPU backend rejects, register spills). In a child process: the interpreter is on in this one.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not from a cache
    script = os.path.join(os.path.dirname(__file__), "compile_triton_ops.py")
    done = subprocess.run([sys.executable, script, "--archs", "80,90"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TRITON_DEFAULT_FP_FUSION" not in done.stderr  # every launch names its fp fusion (LAUNCH_OPTIONS)
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    from tests.layers.compile_triton_ops import VARIANTS
    assert len(rows) == 2 * sum(len(dtypes) for *_, dtypes in VARIANTS) > 30
    assert all("error" not in r for r in rows), [r for r in rows if "error" in r]
    assert all(0 < r["regs"] <= 255 for r in rows), rows
    # no spills to local memory, but in the chunked delta rule's two kernels (see triton_ops.delta_dot): theirs stay
    # what they were when written, not worse: under 1 KB a thread on bf16 operands; on fp32 ones up to ~10 KB on
    # sm_80, ~1.3 KB on sm_90
    assert all(r["stack"] == 0 for r in rows if not r["kernel"].startswith("chunk-")), rows
    assert all(r["stack"] <= 1024 for r in rows if r["dtypes"].startswith("bf16")), rows
    assert all(r["stack"] <= (12288 if r["arch"] == 80 else 1536) for r in rows), rows
