"""PanelLinear (the C++ GEMM's panels), PackedLinear (MKL-packed fp32 weights) and DenseLinear (oneDNN's GEMM): equal
to F.linear at every batch size, ties kept, no-op off CPU fp32; the probe that picks among the three GEMMs."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ascendserve.layers import linear as packed
from ascendserve.layers.linear import DenseLinear, PackedLinear, PanelLinear, dense_linear, packing_supported
from ascendserve.layers.compact_linear import Bf16Linear, tile_kernels
from ascendserve.layers.prepack import prepack_linears_
from tests.layers.kernel_checks import assert_fp32_product

pytestmark = pytest.mark.skipif(not packing_supported(), reason="torch without MKL's packed GEMM")

# Row counts around the thresholds: 1..70 crosses PACK_ROWS (64); 128/129 cross MAX_PACKED_ROWS; 300 is prefill.
ROWS = list(range(1, 71)) + [127, 128, 129, 300]


def _assert_close_to_linear(layer: nn.Module, weight: torch.Tensor, bias, rows: int, k: int) -> None:
    x = torch.randn(rows, k)
    ref, out = F.linear(x, weight, bias), layer(x)
    assert out.shape == ref.shape
    # fp32 rounding level: measured max |diff| ~1e-6 on outputs of scale ~10 (a different sum order)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max(), rows


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("any_rows", [None, False])  # None: as detected (any M from one pack); False: padded
def test_equals_f_linear_for_every_row_count(bias, any_rows):
    torch.manual_seed(0)
    linear = nn.Linear(576, 960, bias=bias)
    layer = PackedLinear(linear, any_rows)
    for rows in ROWS:
        _assert_close_to_linear(layer, linear.weight, linear.bias, rows, 576)
    assert layer(torch.randn(2, 3, 576)).shape == (2, 3, 960)  # leading dims are flattened to rows


def test_this_mkl_takes_any_row_count_from_one_pack():
    # Where this fails the layers still work (padded to PACK_ROWS), but decode is slower: worth knowing.
    layer = PackedLinear(nn.Linear(64, 48))
    assert layer.any_rows and layer.max_rows == packed.MAX_PACKED_ROWS


def test_padded_mode_uses_f_linear_above_the_pack_rows():
    layer = PackedLinear(nn.Linear(64, 48), any_rows=False)
    assert layer.max_rows == packed.PACK_ROWS


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 32)
        self.proj = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, 100, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


def test_prepack_swaps_linears_and_keeps_the_tie(caplog, force_gemm):
    force_gemm("mkl")
    model = _TiedLM()
    weight_ptr = model.embed_tokens.weight.data_ptr()
    num_params = len(list(model.parameters()))
    with caplog.at_level(logging.INFO):
        stats = prepack_linears_(model)
    assert isinstance(model.proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == weight_ptr  # shared storage, no copy
    assert len(list(model.parameters())) == num_params
    assert set(model.state_dict()) == {"embed_tokens.weight", "proj.weight", "proj.bias", "lm_head.weight"}
    assert stats["packed"] == 2 and stats["weight_bytes"] == (32 * 32 + 100 * 32) * 4
    assert "MKL-packed 2" in caplog.text and "MiB" in caplog.text
    for rows in (3, 300):  # the pack, then F.linear: both multiply by the embedding's values
        x = torch.randn(rows, 32)
        assert torch.allclose(model.lm_head(x), x @ model.embed_tokens.weight.t(), atol=1e-5)


@pytest.mark.parametrize("dtype, device", [(torch.bfloat16, "cpu"), (torch.float32, "meta"), (torch.bfloat16, "meta")])
def test_prepack_leaves_non_cpu_layers_and_probes_no_gemm_without_fp32_cpu_layers(dtype, device, monkeypatch):
    probes = []
    monkeypatch.setattr(packed, "fp32_gemm", lambda: probes.append(1) or "onednn")
    model = nn.Sequential(nn.Linear(32, 32, dtype=dtype, device=device))
    stats = prepack_linears_(model)
    assert stats["packed"] == stats["onednn"] == stats["panel"] == 0
    assert not probes  # no GEMM probe without an fp32 CPU layer
    # a bf16 CPU layer goes to the bf16 kernel (test_bf16_linear.py), where the kernels build; the rest stay
    assert type(model[0]) is (nn.Linear if device == "meta" or tile_kernels() is None else Bf16Linear)


def test_prepack_is_a_no_op_when_turned_off(monkeypatch, force_gemm):
    force_gemm("mkl")
    monkeypatch.setenv(packed.ENV_VAR, "0")
    model = nn.Sequential(nn.Linear(32, 32))
    assert prepack_linears_(model)["packed"] == 0
    assert type(model[0]) is nn.Linear


# -- oneDNN's GEMM (DenseLinear), where the probe finds it faster than MKL's ----------------------------------
needs_onednn = pytest.mark.skipif(not hasattr(torch.ops.mkldnn, "_linear_pointwise"), reason="torch without oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_dense_linear_on_onednn_equals_f_linear(bias, force_gemm):
    force_gemm("onednn")
    torch.manual_seed(0)
    linear = nn.Linear(576, 960, bias=bias)
    layer = DenseLinear(linear)
    assert layer.weight is linear.weight
    for rows in (1, 3, 64, 300):
        _assert_close_to_linear(layer, linear.weight, linear.bias, rows, 576)
    x = torch.randn(2, 3, 576)[:, ::2]  # leading dims flattened, a non-contiguous input copied
    assert torch.allclose(layer(x), F.linear(x, linear.weight, linear.bias), atol=1e-5)
    assert layer(torch.randn(0, 576)).shape == (0, 960)
    assert dense_linear(x.double(), linear.weight.double()).dtype == torch.float64  # not fp32: F.linear


@needs_onednn
def test_prepack_makes_dense_linears_on_onednn_and_keeps_the_tie(force_gemm):
    force_gemm("onednn")
    model = _TiedLM()
    stats = prepack_linears_(model)
    assert type(model.proj) is DenseLinear and type(model.lm_head) is DenseLinear
    assert stats["onednn"] == 2 and stats["packed"] == 0  # no MKL pack beside it
    assert model.lm_head.weight is model.embed_tokens.weight
    x = torch.randn(300, 32)
    assert torch.allclose(model.lm_head(x), x @ model.embed_tokens.weight.t(), atol=1e-5)


@needs_onednn
def test_the_gemm_probe_times_each_once_and_an_environment_choice_skips_it(monkeypatch, caplog, force_gemm, kernels):
    monkeypatch.delenv(packed.FP32_GEMM_ENV_VAR, raising=False)
    packed.gemm_probe_ms.cache_clear()
    try:
        with caplog.at_level(logging.INFO):
            picked = packed.fp32_gemm()
            assert packed.fp32_gemm() == picked  # cached: one probe a process
            packed.onednn_gemm_faster()  # the same probe's times
            packed.onednn_gemm_faster(packed.LARGE_ROWS - 1)
        assert caplog.text.count("fp32 GEMM probe") == 1
        ms = packed.gemm_probe_ms(packed.PROBE_ROWS)
        assert set(ms) == {"panel", "onednn", "mkl"} and picked == min(ms, key=ms.get)
        assert packed.onednn_gemm_faster() is (ms["onednn"] < ms["mkl"])
        with caplog.at_level(logging.INFO):  # prefill-sized batches: a second probe, once, at their size
            large = packed.large_batch_gemm()
            assert packed.onednn_gemm_faster(packed.LARGE_ROWS) is packed.onednn_gemm_faster(4096)
        assert caplog.text.count("fp32 GEMM probe") == 2 and "probe (1024 x 1024 rows" in caplog.text
        ms = packed.gemm_probe_ms(packed.LARGE_PROBE_ROWS)
        assert large == min(ms, key=ms.get)
        assert packed.onednn_gemm_faster(packed.LARGE_ROWS) is (ms["onednn"] < ms["mkl"])
    finally:
        packed.gemm_probe_ms.cache_clear()
    for gemm in packed.FP32_GEMMS:
        force_gemm(gemm)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert packed.fp32_gemm() == gemm and packed.large_batch_gemm() == gemm
            if gemm != "panel":
                assert packed.onednn_gemm_faster() is packed.onednn_gemm_faster(4096) is (gemm == "onednn")
        assert "probe" not in caplog.text
    force_gemm("fastest")
    with pytest.raises(ValueError, match="ASCENDSERVE_FP32_GEMM='fastest' is not one of panel, onednn, mkl"):
        packed.fp32_gemm()


# -- the C++ GEMM on panels of 16 outputs (PanelLinear), where the probe finds it the fastest --------------------
# k: one depth block (also an odd one), and 1300 = three blocks of 434 (csrc/f32_linear_cpu.cpp splits k above 640);
# n: whole panels, a last panel of 4 outputs, one panel of 5; rows: the 6-row tiles' edges, a 72-row block and more.
@pytest.mark.parametrize("k, n", [(576, 960), (1300, 100), (37, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_panel_linear_equals_f_linear(kernels, k, n, bias):
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=bias)
    layer = PanelLinear(linear, kernels)
    assert layer.weight is linear.weight and layer.panels.shape == ((n + 15) // 16, k, 16)
    assert set(layer.state_dict()) == {"weight"} | ({"bias"} if bias else set())  # the panels are not saved
    for rows in (*range(1, 14), 64, 72, 73, 150, 300):
        x = torch.randn(rows, k)
        assert_fp32_product(layer(x), x, linear)
        assert_fp32_product(kernels.f32_linear_portable(x, layer.panels, n, linear.bias), x, linear)
    x = torch.randn(2, 6, k)[:, ::2]  # leading dims flattened, a non-contiguous input copied
    assert torch.allclose(layer(x), F.linear(x, linear.weight, linear.bias), atol=1e-4)
    assert layer(torch.randn(0, k)).shape == (0, n)


def test_panel_linear_checks_its_operands(kernels):
    panels = kernels.f32_pack(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="x has 9 columns, the weight 8"):
        kernels.f32_linear(torch.randn(3, 9), panels, 20, None)
    with pytest.raises(RuntimeError, match="n=40 does not match 2 panels"):
        kernels.f32_linear(torch.randn(3, 8), panels, 40, None)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous fp32 \[N\] tensor"):
        kernels.f32_linear(torch.randn(3, 8), panels, 20, torch.randn(19))
    with pytest.raises(RuntimeError, match=r"x must be a contiguous fp32 \[M, K\] tensor"):
        kernels.f32_linear(torch.randn(3, 8).double(), panels, 20, None)


def test_panel_linear_keeps_f_linear_under_compile(kernels, monkeypatch):
    linear = nn.Linear(32, 48)
    layer = PanelLinear(linear, kernels)
    monkeypatch.setattr(kernels, "f32_linear", None, raising=False)  # must not be reached
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x = torch.randn(5, 32)
    assert torch.equal(layer(x), F.linear(x, linear.weight, linear.bias))


def test_panel_linear_hands_large_batches_to_the_gemm_probed_fastest_there(kernels, monkeypatch, force_gemm):
    linear = nn.Linear(64, 48)
    layer = PanelLinear(linear, kernels)
    x = torch.randn(packed.LARGE_ROWS, 64)
    force_gemm("panel")
    assert torch.equal(layer(x), kernels.f32_linear(x, layer.panels, 48, linear.bias))
    force_gemm("mkl")  # large_batch_gemm() and dense_linear: F.linear
    on_panels = layer(x[:-1])
    monkeypatch.setattr(kernels, "f32_linear", None, raising=False)  # must not be reached from LARGE_ROWS rows on
    assert torch.equal(layer(x), packed.dense_linear(x, linear.weight, linear.bias))
    assert torch.equal(layer(x.view(2, -1, 64)), packed.dense_linear(x, linear.weight, linear.bias).view(2, -1, 48))
    assert_fp32_product(on_panels, x[:-1], linear)


def test_prepack_makes_panel_linears_and_keeps_the_tie(force_gemm, caplog):
    force_gemm("panel")
    model = _TiedLM()
    with caplog.at_level(logging.INFO):
        stats = prepack_linears_(model)
    assert type(model.proj) is PanelLinear and type(model.lm_head) is PanelLinear
    assert stats["panel"] == 2 and stats["panel_bytes"] == (2 * 32 + 7 * 32) * 16 * 4
    assert stats["packed"] == stats["onednn"] == 0 and "2 fp32 linear layers also kept as panels" in caplog.text
    assert model.lm_head.weight is model.embed_tokens.weight
    assert set(model.state_dict()) == {"embed_tokens.weight", "proj.weight", "proj.bias", "lm_head.weight"}
    x = torch.randn(300, 32)
    assert torch.allclose(model.lm_head(x), x @ model.embed_tokens.weight.t(), atol=1e-5)
