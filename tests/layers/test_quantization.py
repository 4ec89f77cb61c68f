"""Weight-only int8 / int4: per-layer error bounds, per-call kernel choice, logprob drift end to end."""

import logging
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.qwen3_5 import Qwen3_5TextConfig

from ascendserve import LLM, SamplingParams
from ascendserve.cli.main import build_parser
from ascendserve.cli.serve import warn_no_effect_flags
from ascendserve.config import EngineArgs
from ascendserve.layers import quantization as q
from ascendserve.layers.compact_linear import tile_kernels
from ascendserve.layers.quantization import (GridInt4Linear, GridInt8Linear, WeightOnlyLinear, _unpack_int4,
                                             quantize_model_)
from tests.models.reference import make_prompts, randomize_
from tests.models.qwen3_5_tiny import TEXT as QWEN_TEXT
from tests.models.qwen3_5_tiny import randomize_ as qwen_randomize_

VOCAB = 512
MAX_NEW = 8


@pytest.mark.parametrize("n, k", [(3072, 576), (576, 1536), (48, 64), (80, 128)])
def test_int4_unpack_inverts_the_cpu_pack(n, k):
    values = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(values, 2)
    assert torch.equal(_unpack_int4(packed, n, k), values.to(torch.uint8))


@pytest.mark.parametrize("method, bound", [("int8", 0.01), ("int4", 0.15)])
@pytest.mark.parametrize("rows", [1, 200])  # the integer kernel, then the dequantize path
def test_layer_error_is_bounded_relative_to_the_output(method, bound, rows):
    torch.manual_seed(0)
    linear = nn.Linear(256, 192, bias=True)
    layer = WeightOnlyLinear(linear, method)
    x = torch.randn(rows, 256)
    ref, out = linear(x), layer(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # Max abs error as a fraction of the output's scale; measured 0.004 (int8), 0.05-0.08 (int4).
    assert (out - ref).abs().max() / ref.abs().max() < bound
    assert torch.allclose(layer.dequantize(), linear.weight, atol=bound * linear.weight.abs().max().item())


def test_kernel_choice_is_per_row_count(monkeypatch):
    torch.manual_seed(0)
    calls = []
    for method in ("int8", "int4"):
        layer = WeightOnlyLinear(nn.Linear(64, 64, bias=False), method)
        monkeypatch.setattr(layer, "_kernel", lambda x, f=layer._kernel: calls.append(x.shape[0]) or f(x))
        limit = q.INT_KERNEL_MAX_ROWS[method]
        layer(torch.randn(limit, 64))
        layer(torch.randn(limit + 1, 64))  # above the threshold: dequantize + F.linear, no kernel call
        assert calls == [limit]
        assert layer(torch.randn(2, 3, 64)).shape == (2, 3, 64)  # leading dims are flattened to rows
        assert calls == [limit, 6]
        calls.clear()


def test_quantize_model_swaps_linears_and_keeps_unsupported_shapes_dense(caplog, monkeypatch):
    monkeypatch.setattr(q, "tile_kernels", lambda: None)  # torch's int4 kernel (no SIMD tiles)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))  # N=8: no int4 kernel
    with caplog.at_level(logging.INFO):
        stats = quantize_model_(model, "int4")
    assert isinstance(model[0], WeightOnlyLinear) and isinstance(model[2], nn.Linear)
    assert stats["quantized"] == 1 and stats["skipped"] == 1 and stats["bytes_after"] < stats["bytes_before"]
    assert "int4" in caplog.text and "MiB" in caplog.text


def test_int8_on_torchs_kernel_keeps_inputs_not_a_multiple_of_16_dense(monkeypatch):
    """torch's _weight_int8pack_mm reads out of bounds below K % 16 (a segfault or NaNs, e.g. an intermediate size of
    200): such layers stay dense."""
    monkeypatch.setattr(q, "tile_kernels", lambda: None)
    assert not WeightOnlyLinear.supports(nn.Linear(200, 64), "int8")
    assert WeightOnlyLinear.supports(nn.Linear(80, 64), "int8")
    model = nn.Sequential(nn.Linear(64, 200), nn.ReLU(), nn.Linear(200, 64))
    stats = quantize_model_(model, "int8")
    assert isinstance(model[0], WeightOnlyLinear) and isinstance(model[2], nn.Linear) and stats["skipped"] == 1
    assert torch.isfinite(model(torch.randn(10, 64))).all()


def test_lm_head_always_uses_the_kernel(monkeypatch):
    monkeypatch.setattr(q, "tile_kernels", lambda: None)  # torch's int8 kernel (no SIMD tiles)
    model = nn.Module()
    model.proj, model.lm_head = nn.Linear(64, 64), nn.Linear(64, 512, bias=False)
    quantize_model_(model, "int8")
    assert model.proj.max_kernel_rows == q.INT_KERNEL_MAX_ROWS["int8"]
    assert model.lm_head.max_kernel_rows == q.LM_HEAD_KERNEL_MAX_ROWS


# -- int4 on the 4-bit grid kernel (fp32 models on an AVX-512 or AVX2 CPU) ---------------------------
@pytest.fixture
def grid_kernels():
    kernels = tile_kernels()
    if kernels is None:
        pytest.skip("no SIMD tiles on this CPU: int4 uses torch's kernel (tested above)")
    return kernels


@pytest.mark.parametrize("k, group", [(256, 64), (96, 32)])  # K % 64 != 0: groups of 32
@pytest.mark.parametrize("rows", [1, 7, 300])  # the kernel's tiles, then the dequantize path (above 96 or 256)
def test_grid_int4_is_the_fp32_product_of_its_dequantized_weight(grid_kernels, k, group, rows):
    torch.manual_seed(0)
    linear = nn.Linear(k, 40, bias=True)  # N=40: a padded 32-row panel, which torch's int4 pack cannot take
    layer = GridInt4Linear(linear, grid_kernels)
    assert layer.group_size == group and layer.scales.shape == (2, k // group, 32)
    weight = layer.dequantize()
    # On the grid: each group of a row is m + d * q with q in 0..15, d = (max - min) / 15, m = min.
    blocks = linear.weight.detach().reshape(40, k // group, group)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    steps = (weight.reshape(40, k // group, group) - lo[..., None]) / ((hi - lo) / 15)[..., None]
    assert (steps - steps.round()).abs().max() < 1e-3 and steps.round().min() == 0 and steps.round().max() == 15
    # Round to nearest: within half a step of the original weight.
    assert ((weight - linear.weight).abs().reshape(40, -1, group) <= ((hi - lo) / 30)[..., None] * 1.0001).all()
    x = torch.randn(rows, k)
    ref = F.linear(x.double(), weight.double(), linear.bias.double())
    scale = F.linear(x.double().abs(), weight.double().abs(), linear.bias.double().abs())
    assert ((layer(x).double() - ref).abs() <= 1e-5 * scale).all()


def test_grid_int4_calls_the_kernel_up_to_its_row_limit(grid_kernels, monkeypatch):
    layer = GridInt4Linear(nn.Linear(64, 32), grid_kernels, max_rows=4)
    calls = []
    monkeypatch.setattr(layer, "_kernel", lambda x, f=layer._kernel: calls.append(x.shape[0]) or f(x))
    layer(torch.randn(4, 64))
    layer(torch.randn(5, 64))
    assert calls == [4]


def test_int4_on_fp32_cpu_layers_uses_the_grid_kernel_for_every_shape(grid_kernels, caplog):
    model = nn.Module()
    model.proj, model.heads, model.lm_head = nn.Linear(64, 128), nn.Linear(128, 8), nn.Linear(64, 512, bias=False)
    with caplog.at_level(logging.INFO):
        stats = quantize_model_(model, "int4")
    assert all(isinstance(m, GridInt4Linear) for m in (model.proj, model.heads, model.lm_head))
    assert stats["quantized"] == 3 and stats["skipped"] == 0
    assert model.proj.max_rows == q.GRID_KERNEL_MAX_ROWS[grid_kernels.tile_lanes()]
    assert model.lm_head.max_rows == q.LM_HEAD_KERNEL_MAX_ROWS
    # 0.625 bytes a weight with fp32 d and m per 64 inputs (N padded to 32-row panels), biases fp32.
    assert stats["bytes_after"] == (128 * 64 + 32 * 128 + 512 * 64) * 5 // 8 + (128 + 8) * 4
    assert "int4" in caplog.text


# -- int8 on the 8-bit grid kernel (csrc/q8_linear_cpu.cpp) --------------------------------------------------
@pytest.mark.parametrize("rows", [1, 7, 40])  # the kernel's tiles (max_rows 8: then the dequantize path)
def test_grid_int8_is_the_fp32_product_of_its_dequantized_weight(grid_kernels, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True)  # N=40: a padded 32-row panel
    assert GridInt8Linear(linear, grid_kernels).max_rows == q.INT8_GRID_KERNEL_MAX_ROWS[grid_kernels.tile_lanes()]
    layer = GridInt8Linear(linear, grid_kernels, max_rows=8)
    assert layer.scales.shape == (2, 3, 32)
    weight = layer.dequantize()
    # On the grid: each block of 32 inputs of a row is d * q with q in -127..127, d = (its largest magnitude) / 127,
    # q rounded to nearest: within half a step of the original weight.
    blocks = linear.weight.detach().reshape(40, 3, 32)
    d = blocks.abs().amax(-1) / 127
    steps = weight.reshape(40, 3, 32) / d[..., None]
    assert (steps - steps.round()).abs().max() < 1e-3 and steps.round().abs().max() == 127
    assert ((weight - linear.weight).abs().reshape(40, 3, 32) <= (d / 2)[..., None] * 1.0001).all()
    x = torch.randn(rows, 96)
    ref = F.linear(x.double(), weight.double(), linear.bias.double())
    scale = F.linear(x.double().abs(), weight.double().abs(), linear.bias.double().abs())
    assert ((layer(x).double() - ref).abs() <= 1e-5 * scale).all()


def test_int8_on_cpu_layers_uses_the_grid_kernel(grid_kernels, caplog):
    model = nn.Module()
    model.proj, model.heads, model.lm_head = nn.Linear(64, 128), nn.Linear(128, 8), nn.Linear(64, 512, bias=False)
    model.odd = nn.Linear(48, 16)  # in_features not a multiple of 32: torch's kernel
    with caplog.at_level(logging.INFO):
        stats = quantize_model_(model, "int8")
    assert all(isinstance(m, GridInt8Linear) for m in (model.proj, model.heads, model.lm_head))
    assert isinstance(model.odd, WeightOnlyLinear) and stats["quantized"] == 4
    assert model.proj.max_rows == q.INT8_GRID_KERNEL_MAX_ROWS[grid_kernels.tile_lanes()]
    assert model.lm_head.max_rows == q.LM_HEAD_KERNEL_MAX_ROWS
    # 1.125 bytes a weight (fp32 d per 32 inputs; N padded to 32-row panels), biases fp32; torch's int8 layer a byte
    # a weight and a bf16 scale per row
    assert stats["bytes_after"] == (128 * 64 + 32 * 128 + 512 * 64) * 9 // 8 + (128 + 8 + 16) * 4 + 16 * 48 + 16 * 2
    assert "int8" in caplog.text


class _Bf16Block(nn.Module):
    fp32_output_linears = ("gates",)

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.gates, self.lm_head = nn.Linear(64, 40), nn.Linear(64, 32), nn.Linear(64, 96, bias=False)
        self.odd = nn.Linear(48, 32)  # in_features not a multiple of 32: stays dense
        self.to(torch.bfloat16)


@pytest.mark.parametrize("int8_activations", [False, True])
def test_int4_on_bf16_layers_uses_the_grid_kernel_with_bf16_io(grid_kernels, int8_activations):
    torch.manual_seed(0)
    model = _Bf16Block()
    stats = quantize_model_(model, "int4", int8_activations=int8_activations)
    assert all(isinstance(getattr(model, name), GridInt4Linear) for name in ("proj", "gates", "lm_head"))
    assert type(model.odd) is nn.Linear and stats["quantized"] == 3 and stats["skipped"] == 1
    assert model.proj.bf16_io and not model.proj.fp32_out and model.gates.fp32_out and model.lm_head.fp32_out
    weight = model.proj.dequantize().double()
    for rows in (1, 2, 9, 300):  # one kernel for every batch (with int8 activations: from two rows on)
        x = torch.randn(rows, 64).bfloat16()
        out = model.proj(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 40)
        ref = F.linear(x.double(), weight, model.proj.bias.double())
        scale = F.linear(x.double().abs(), weight.abs(), model.proj.bias.double().abs())
        # rounded to bf16 once (2^-8 relative), plus the int8 rounding of x where it applies (1/254 of max |x|)
        bound = (2.0 ** -8 + (2 / 127 if int8_activations and rows > 1 else 0)) * scale + 1e-6
        assert ((out.double() - ref).abs() <= bound).all(), rows
    assert model.gates(x).dtype == model.lm_head(x).dtype == torch.float32  # fp32 sums, not rounded
    assert "bf16 in and out" in repr(model.proj) and "fp32 out" in repr(model.lm_head)


def test_int8_on_bf16_layers_uses_the_grid_kernel_with_bf16_io(grid_kernels):
    torch.manual_seed(0)
    model = _Bf16Block()
    stats = quantize_model_(model, "int8")
    assert all(isinstance(getattr(model, name), GridInt8Linear) for name in ("proj", "gates", "lm_head"))
    assert isinstance(model.odd, WeightOnlyLinear) and stats["quantized"] == 4
    assert model.proj.bf16_io and not model.proj.fp32_out and model.gates.fp32_out and model.lm_head.fp32_out
    weight = model.proj.dequantize().double()
    for rows in (1, 2, 13, 300):  # one kernel for every batch
        x = torch.randn(rows, 64).bfloat16()
        out = model.proj(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 40)
        ref = F.linear(x.double(), weight, model.proj.bias.double())
        scale = F.linear(x.double().abs(), weight.abs(), model.proj.bias.double().abs())
        assert ((out.double() - ref).abs() <= 2.0 ** -8 * scale + 1e-6).all(), rows  # rounded to bf16 once
    assert model.gates(x).dtype == model.lm_head(x).dtype == torch.float32  # fp32 sums, not rounded
    assert "bf16 in and out" in repr(model.proj) and "fp32 out" in repr(model.lm_head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activations_on_int8_layers_where_the_cpu_has_vnni(grid_kernels, dtype):
    torch.manual_seed(0)
    model = nn.Module()
    model.proj, model.lm_head = nn.Linear(64, 40), nn.Linear(64, 96, bias=False)
    model.to(dtype)
    stats = quantize_model_(model, "int8", int8_activations=True)
    vnni = grid_kernels.q4_a8_tile() == "avx512_vnni"
    assert stats["int8_activations"] == (2 if vnni else 0) and model.proj.int8_activations == vnni
    if not vnni:
        return
    calls = []
    real = grid_kernels.q8_a8_linear
    model.proj.kernels = types.SimpleNamespace(**{name: getattr(grid_kernels, name) for name in (
        "q8_linear", "q8_linear_bf16x", "q4_a8_tile")}, q8_a8_linear=lambda x, *a: calls.append(len(x)) or real(x, *a))
    weight = model.proj.dequantize().double()
    for rows in (1, q.INT8_A8_MIN_ROWS - 1, q.INT8_A8_MIN_ROWS, 300):  # int8 activations from INT8_A8_MIN_ROWS rows
        x = torch.randn(rows, 64).to(dtype)
        out = model.proj(x)
        assert out.dtype == dtype and out.shape == (rows, 40)
        ref = F.linear(x.double(), weight, model.proj.bias.double())
        scale = F.linear(x.double().abs(), weight.abs(), model.proj.bias.double().abs())
        # x rounded to int8 per 32 inputs: up to half a step (1/254 of a block's largest |x|) per value; bf16 output
        bound = (2 / 127 if rows >= q.INT8_A8_MIN_ROWS else 0) + (2.0 ** -8 if dtype == torch.bfloat16 else 1e-5)
        assert ((out.double() - ref).abs() <= bound * scale + 1e-6).all(), rows
    assert calls == [q.INT8_A8_MIN_ROWS, 300]
    assert "int8 activations" in repr(model.proj)


# -- end to end: logprob drift of the greedy tokens against the unquantized engine ----------------------
def _llama(path):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed=1, std=0.05)
    model.save_pretrained(path)


def _qwen3_5(path):
    config = Qwen3_5TextConfig(**QWEN_TEXT, intermediate_size=128, tie_word_embeddings=True)
    config.architectures = ["Qwen3_5ForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    qwen_randomize_(model, seed=1, std=0.05)
    model.save_pretrained(path)


# The engine's arguments per measured method (the reference: the unquantized fp32 engine).
METHODS = {"int8": {"quantization": "int8"}, "int4": {"quantization": "int4"},
           "int4+a8": {"quantization": "int4", "activation_quantization": "int8"},
           "bf16": {"dtype": "bfloat16"}, "int4 bf16": {"dtype": "bfloat16", "quantization": "int4"},
           "int8 bf16": {"dtype": "bfloat16", "quantization": "int8"},
           "int8+a8": {"quantization": "int8", "activation_quantization": "int8"}}


def _drift(path: str, method: str, prompts, reference) -> list[float]:
    """|logprob| change of each reference token, teacher-forced (the reference's own prefix each step)."""
    llm = LLM(path, skip_tokenizer_init=True, max_logprobs=-1, **{"dtype": "float32", **METHODS[method]})
    requests, targets = [], []
    for prompt, (tokens, _) in zip(prompts, reference):
        for i in range(MAX_NEW):
            requests.append({"prompt_token_ids": prompt + tokens[:i]})
            targets.append(tokens[i])
    # Every token's logprob (the whole vocabulary), so each reference token's drift is measured, not cut
    # off at a top-k: these random models' next-token distributions are nearly flat (top logprobs about
    # -5 for 512 tokens), where a drift of 0.5 can move a token from 3rd to 30th.
    outputs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=1, logprobs=VOCAB, ignore_eos=True),
                           use_tqdm=False)
    ref_logprobs = [lp for _, lps in reference for lp in lps]
    return [abs(out.outputs[0].logprobs[0][t].logprob - ref)
            for out, t, ref in zip(outputs, targets, ref_logprobs)]


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def drift(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    torch.manual_seed(0)
    {"llama": _llama, "qwen3_5": _qwen3_5}[request.param](path)
    prompts = make_prompts(VOCAB, [5, 17, 40], seed=2)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", max_logprobs=-1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0, ignore_eos=True),
                           use_tqdm=False)
    reference = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                          o.outputs[0].token_ids)])
                 for o in outputs]
    del llm
    methods = tuple(METHODS) if tile_kernels() is not None else ("int8", "int4")
    return {method: _drift(path, method, prompts, reference) for method in methods}


def test_int8_drift_is_small_and_int4_bounded(drift):
    stats = {m: (sum(d) / len(d), max(d)) for m, d in drift.items()}
    print("logprob drift (mean, max):", stats)
    # Measured (llama, qwen3_5): int8 on the grid kernel (per 32 inputs) mean 0.008, 0.010 (max 0.02, 0.04), on
    # torch's kernel (per row) 0.009, 0.013 (max 0.02, 0.04); int4 on the grid kernel (fp32 models on an AVX-512 CPU)
    # mean 0.10, 0.13 (max 0.24, 0.32); int4 on torch's kernel mean 0.11, 0.14 (max 0.29, 0.46).
    assert stats["int8"][0] < 0.04 and stats["int8"][1] < 0.15
    assert stats["int4"][0] < 0.3 and stats["int4"][1] < 1.5
    assert stats["int8"][0] < stats["int4"][0]


def test_int8_activations_add_little_to_int8_drift(drift):
    """--activation-quantization int8 on top of --quantization int8 (GridInt8Linear's q8_a8_linear where the CPU
    has AVX512-VNNI; elsewhere the flag leaves int8 as it is). The teacher-forced steps run a row per request in
    one batch, so the kernel takes them (more than INT8_A8_MIN_ROWS rows)."""
    if "int8+a8" not in drift:
        pytest.skip("no CPU kernels with SIMD tiles here")
    int8, a8 = (sum(drift[m]) / len(drift[m]) for m in ("int8", "int8+a8"))
    print(f"logprob drift, mean: int8 {int8:.3f}, int8 + int8 activations {a8:.3f}, max {max(drift['int8+a8']):.3f}")
    assert a8 < 0.1 and max(drift["int8+a8"]) < 0.5


def test_int8_activations_add_little_to_int4_drift(drift):
    """--activation-quantization int8 on top of --quantization int4 (GridInt4Linear on the CPU kernels)."""
    if "int4+a8" not in drift:
        pytest.skip("no CPU kernels with SIMD tiles here: int4 runs on torch's kernel, int8 activations do not apply")
    int4, a8 = (sum(drift[m]) / len(drift[m]) for m in ("int4", "int4+a8"))
    print(f"logprob drift, mean: int4 {int4:.3f}, int4 + int8 activations {a8:.3f}, max {max(drift['int4+a8']):.3f}")
    assert a8 < 1.3 * int4 and max(drift["int4+a8"]) < 1.5


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantized_bf16_drifts_about_as_in_fp32_plus_bf16(drift, method):
    """--quantization int4 / int8 in a bf16 model: GridInt4Linear's / GridInt8Linear's bf16 kernels
    (q4_linear_bf16x, q8_linear_bf16x). Their drift from the fp32 engine is about the method's in fp32 plus bf16's
    own."""
    if f"{method} bf16" not in drift:
        pytest.skip("no CPU kernels with SIMD tiles here: int4 and int8 run on torch's kernels")
    mean = {m: sum(drift[m]) / len(drift[m]) for m in (method, "bf16", f"{method} bf16")}
    print("logprob drift, mean:", mean, f"max, {method} in bf16:", max(drift[f"{method} bf16"]))
    assert mean[f"{method} bf16"] < 1.3 * (mean[method] + mean["bf16"]) and max(drift[f"{method} bf16"]) < 1.5


# -- configuration and CLI ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["fp8", "awq", "gptq", "int3", 8])
def test_bad_quantization_is_a_value_error_naming_the_field(value):
    with pytest.raises(ValueError, match="quantization") as info:
        EngineArgs.from_kwargs(quantization=value)
    assert "int8" in str(info.value) and "int4" in str(info.value)
    if value in ("fp8", "awq", "gptq"):
        assert "not supported" in str(info.value)


def test_serve_quantization_int8_is_effective_and_does_not_warn():
    ns = build_parser().parse_args(["serve", "--quantization", "int8"])
    assert warn_no_effect_flags(ns) == [] and ns.quantization == "int8"
    ns = build_parser().parse_args(["serve", "--quantization", "ascend"])  # a checkpoint method: inert
    assert warn_no_effect_flags(ns) == ["--quantization"] and ns.quantization is None


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantization_off_the_cpu_is_a_clear_error_before_loading(method):
    from ascendserve.loader.model_loader import _check_quantization_device
    from ascendserve.platforms import get_platform
    _check_quantization_device(EngineArgs(quantization=method), get_platform("cpu"))
    for name in ("cuda", "npu"):
        with pytest.raises(ValueError, match=f"quantization='{method}' .* runs on the CPU only; the device is {name}"):
            _check_quantization_device(EngineArgs(quantization=method), types.SimpleNamespace(name=name))
    _check_quantization_device(EngineArgs(), types.SimpleNamespace(name="cuda"))


@pytest.mark.parametrize("value", ["int4", "fp8", 8])
def test_bad_activation_quantization_is_a_value_error_naming_the_field(value):
    with pytest.raises(ValueError, match="activation_quantization must be one of \\[None, 'int8'\\]"):
        EngineArgs.from_kwargs(activation_quantization=value)


def test_serve_activation_quantization_flag(capsys):
    from ascendserve.cli.engine_flags import engine_args_from
    ns = build_parser().parse_args(["serve", "--quantization", "int4", "--activation-quantization", "int8"])
    assert warn_no_effect_flags(ns) == [] and engine_args_from(ns).activation_quantization == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--activation-quantization", "fp8"])
    assert "--activation-quantization: invalid choice: 'fp8'" in capsys.readouterr().err


def test_int8_activations_without_4bit_layers_warn(tmp_path, caplog):
    _llama(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", activation_quantization="int8")
    assert "--activation-quantization int8 has no effect" in caplog.text
