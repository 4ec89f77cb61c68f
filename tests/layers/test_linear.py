"""PackedLinear (MKL-packed fp32 weights) and DenseLinear (oneDNN's GEMM): equal to F.linear at every batch size,
ties kept, no-op off CPU fp32; the probe that picks between the two GEMMs."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ascendserve.layers import linear as packed
from ascendserve.layers.linear import DenseLinear, PackedLinear, dense_linear, packing_supported
from ascendserve.layers.prepack import prepack_linears_

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
    force_gemm(onednn=False)
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


@pytest.mark.parametrize("dtype, device", [(torch.bfloat16, "cpu"), (torch.float32, "meta")])
def test_prepack_is_a_no_op_off_cpu_fp32(dtype, device, monkeypatch):
    probes = []
    monkeypatch.setattr(packed, "onednn_gemm_faster", lambda: probes.append(1) or True)
    model = nn.Sequential(nn.Linear(32, 32, dtype=dtype, device=device))
    assert prepack_linears_(model)["packed"] == 0
    assert type(model[0]) is nn.Linear and not probes  # no GEMM probe without an fp32 CPU layer


def test_prepack_is_a_no_op_when_turned_off(monkeypatch, force_gemm):
    force_gemm(onednn=False)
    monkeypatch.setenv(packed.ENV_VAR, "0")
    model = nn.Sequential(nn.Linear(32, 32))
    assert prepack_linears_(model)["packed"] == 0
    assert type(model[0]) is nn.Linear


# -- oneDNN's GEMM (DenseLinear), where the probe finds it faster than MKL's ----------------------------------
needs_onednn = pytest.mark.skipif(not hasattr(torch.ops.mkldnn, "_linear_pointwise"), reason="torch without oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_dense_linear_on_onednn_equals_f_linear(bias, force_gemm):
    force_gemm(onednn=True)
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
    force_gemm(onednn=True)
    model = _TiedLM()
    stats = prepack_linears_(model)
    assert type(model.proj) is DenseLinear and type(model.lm_head) is DenseLinear
    assert stats["onednn"] == 2 and stats["packed"] == 0  # no MKL pack beside it
    assert model.lm_head.weight is model.embed_tokens.weight
    x = torch.randn(300, 32)
    assert torch.allclose(model.lm_head(x), x @ model.embed_tokens.weight.t(), atol=1e-5)


@needs_onednn
def test_the_gemm_probe_times_both_once_and_an_environment_choice_skips_it(monkeypatch, caplog, force_gemm):
    monkeypatch.delenv(packed.ONEDNN_ENV_VAR, raising=False)
    packed.onednn_gemm_faster.cache_clear()
    with caplog.at_level(logging.INFO):
        picked = packed.onednn_gemm_faster()
        assert packed.onednn_gemm_faster() is picked  # cached: one probe a process
    assert caplog.text.count("fp32 GEMM probe") == 1 and ("oneDNN" if picked else "MKL") + " for fp32" in caplog.text
    for value, expected in (("1", True), ("0", False)):
        force_gemm(onednn=expected)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert packed.onednn_gemm_faster() is expected
        assert "probe" not in caplog.text
