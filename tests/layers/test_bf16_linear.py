"""Bf16Linear: bf16-stored weights multiplied in fp32 by the C++ kernel, against an fp64 F.linear."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ascendserve.layers import cpu_kernels
from ascendserve.layers import compact_linear
from ascendserve.layers.activation import GatedActivation
from ascendserve.layers.compact_linear import (Bf16Embedding, Bf16GateUpSilu, Bf16Linear, bf16_valued, pack_bf16,
                                               pack_gate_up)
from ascendserve.layers.linear import PanelLinear
from ascendserve.layers.prepack import compact_embeddings_, prepack_linears_
from ascendserve.platforms.cpu import cpu_flags
from tests.layers.kernel_checks import assert_fp32_product, assert_kernel_rows, fp32_layer_type


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _bf16_valued_linear(k: int, n: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.bfloat16().float())
    return layer


# (K, N): N below, at and between multiples of the 32-row panel; K small, SmolLM2's and Qwen3.5's.
SHAPES = [(2, 1), (10, 37), (64, 64), (576, 96), (1024, 200)]
# Every tile height (1-6 with even / odd accumulators, 7-12 merged), blocks of 12 with remainders, the
# 256 KiB row chunk (64 rows at K=1024), and the kernel limit.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 24, 25, 63, 64, 65, 130, 256, 257, 300]


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("op", ["bf16_linear", "bf16_linear_portable"])
def test_kernel_is_the_fp32_product_of_the_bf16_weight(kernels, k, n, bias, op):
    layer = _bf16_valued_linear(k, n, bias)
    assert_kernel_rows(getattr(kernels, op), (pack_bf16(layer.weight.detach()),), layer, ROWS)


@pytest.mark.parametrize("k,n", SHAPES)
def test_unpack_gives_back_the_exact_weight(kernels, k, n):
    layer = _bf16_valued_linear(k, n, False)
    assert torch.equal(kernels.bf16_unpack(pack_bf16(layer.weight.detach()), n), layer.weight)


class _Recording:
    """The real kernels, recording which op each call used."""

    def __init__(self, ops) -> None:
        self._ops, self.calls = ops, []

    def __getattr__(self, name):
        op = getattr(self._ops, name)
        return lambda *args: self.calls.append(name) or op(*args)


@pytest.mark.parametrize("large", ["widen", "kernel"])
def test_layer_above_the_kernel_rows_widens_the_weight_or_keeps_the_kernel(kernels, monkeypatch, large):
    monkeypatch.setenv(compact_linear.BF16_LARGE_ENV_VAR, large)
    layer = _bf16_valued_linear(576, 96, True)
    recording = _Recording(kernels)
    bf16 = Bf16Linear(layer, recording)
    assert bf16.large_on_kernel is (large == "kernel")
    for rows in (1, compact_linear.BF16_KERNEL_MAX_ROWS, compact_linear.BF16_KERNEL_MAX_ROWS + 1, 700):
        x = torch.randn(rows, 576)
        assert_fp32_product(bf16(x), x, layer)
    above = ["bf16_linear"] * 2 if large == "kernel" else ["bf16_unpack"] * 2
    assert recording.calls == ["bf16_linear", "bf16_linear", *above]
    x = torch.randn(2, 3, 576)[:, ::2]  # leading dims flattened; a non-contiguous input is copied
    assert_fp32_product(bf16(x).reshape(-1, 96), x.reshape(-1, 576), layer)
    assert bf16.packed.dtype == torch.bfloat16 and bf16.packed.numel() * 2 == 576 * 96 * 2


def test_large_batches_take_the_kernel_on_avx2_tiles_unless_the_environment_says(kernels, monkeypatch):
    monkeypatch.delenv(compact_linear.BF16_LARGE_ENV_VAR, raising=False)
    assert compact_linear.bf16_kernel_for_large_batches() is (kernels.tile_lanes() == 8)
    for value in ("kernel", "widen"):
        monkeypatch.setenv(compact_linear.BF16_LARGE_ENV_VAR, value)
        assert compact_linear.bf16_kernel_for_large_batches() is (value == "kernel")
    monkeypatch.setenv(compact_linear.BF16_LARGE_ENV_VAR, "dense")
    with pytest.raises(ValueError, match="ASCENDSERVE_BF16_LARGE_BATCHES='dense' is not one of kernel, widen"):
        compact_linear.bf16_kernel_for_large_batches()


def test_kernel_rejects_mismatched_inputs(kernels):
    packed = pack_bf16(_bf16_valued_linear(64, 40, False).weight.detach())
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        kernels.bf16_linear(torch.randn(3, 32), packed, 40, None)
    with pytest.raises(RuntimeError, match="n=70 does not match 2 panels"):
        kernels.bf16_linear(torch.randn(3, 64), packed, 70, None)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        kernels.bf16_linear(torch.randn(3, 64, dtype=torch.float64), packed, 40, None)


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 32)
        self.proj = nn.Linear(32, 32)  # bf16 values
        self.odd = nn.Linear(31, 32)  # bf16 values, odd in_features: the kernel takes pairs
        self.fp32 = nn.Linear(32, 32)  # fp32 values
        self.lm_head = nn.Linear(32, 100, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        with torch.no_grad():
            for module in (self.embed_tokens, self.proj, self.odd):
                module.weight.copy_(module.weight.bfloat16().float())


def test_prepack_keeps_bf16_valued_weights_as_bf16(kernels, caplog):
    model = _TiedLM()
    embedding = model.embed_tokens.weight.detach().clone()
    with caplog.at_level(logging.INFO):
        stats = prepack_linears_(model)
    assert isinstance(model.proj, Bf16Linear) and isinstance(model.lm_head, Bf16Linear)
    expected_fp32 = fp32_layer_type()
    assert type(model.odd) is expected_fp32 and type(model.fp32) is expected_fp32
    assert stats["bf16"] == 2 and stats["bf16_bytes"] == (32 * 32 + 128 * 32) * 2  # the pack pads N to 32 rows
    assert "2 fp32 linear layers hold bf16 values" in caplog.text and compact_linear.COMPACT_ENV_VAR in caplog.text
    assert torch.equal(model.embed_tokens.weight, embedding)  # the embedding keeps its fp32 tensor
    x = torch.randn(5, 32)
    reference = nn.Linear(32, 100, bias=False)
    reference.weight = nn.Parameter(embedding)
    assert_fp32_product(model.lm_head(x), x, reference)


def test_tied_embedding_becomes_bf16_once_the_lm_head_no_longer_holds_it(kernels, caplog):
    model = _TiedLM()
    fp32_table = model.embed_tokens.weight.detach().clone()
    assert compact_embeddings_(model) == 0  # the fp32 lm_head still reads the same tensor: nothing freed
    assert type(model.embed_tokens) is nn.Embedding
    prepack_linears_(model)  # the lm_head becomes bf16 panels of its own
    with caplog.at_level(logging.INFO):
        assert compact_embeddings_(model) == 100 * 32 * 2
    assert isinstance(model.embed_tokens, Bf16Embedding) and model.embed_tokens.weight.dtype == torch.bfloat16
    assert "kept as bf16" in caplog.text
    ids = torch.tensor([[0, 5, 99], [7, 7, 1]])
    out = model.embed_tokens(ids)
    assert out.dtype == torch.float32 and torch.equal(out, fp32_table[ids])  # the same fp32 values
    assert [name for name, _ in model.embed_tokens.named_buffers()] == ["weight"]


def test_embedding_with_values_off_the_bf16_grid_or_switched_off_stays_fp32(monkeypatch):
    model = nn.Module()
    model.embed_tokens = nn.Embedding(100, 32)  # fp32 values
    assert compact_embeddings_(model) == 0 and type(model.embed_tokens) is nn.Embedding
    with torch.no_grad():
        model.embed_tokens.weight.copy_(model.embed_tokens.weight.bfloat16().float())
    monkeypatch.setenv(compact_linear.COMPACT_ENV_VAR, "0")
    assert compact_embeddings_(model) == 0 and type(model.embed_tokens) is nn.Embedding
    monkeypatch.delenv(compact_linear.COMPACT_ENV_VAR)
    assert compact_embeddings_(model) > 0 and isinstance(model.embed_tokens, Bf16Embedding)


def test_bf16_valued_checks_every_row_pass():
    weight = torch.randn(10, 6).bfloat16().float()
    assert bf16_valued(weight, rows_per_pass=3)
    weight[9, 5] = 1.0 + 2.0 ** -20  # not a bf16, only in the last, partial pass
    assert not bf16_valued(weight, rows_per_pass=3) and not bf16_valued(weight)


@pytest.mark.parametrize("env", [compact_linear.COMPACT_ENV_VAR, "ASCENDSERVE_CPU_KERNELS"])
def test_bf16_weights_stay_fp32_when_turned_off(monkeypatch, env):
    monkeypatch.setenv(env, "0")
    monkeypatch.delitem(cpu_kernels._state, "ops", raising=False)  # loaded again, under the switch
    model = _TiedLM()
    stats = prepack_linears_(model)
    assert stats["bf16"] == 0
    assert not any(isinstance(m, Bf16Linear) for m in model.modules())
    if env == "ASCENDSERVE_CPU_KERNELS":  # nor the C++ GEMM's panels, whatever the probe found
        assert stats["panel"] == 0 and not any(isinstance(m, PanelLinear) for m in model.modules())


def test_kernels_report_their_simd_tiles_as_the_cpu_has_them(kernels):
    flags = cpu_flags()
    # built with -march=native: AVX-512 tiles, else AVX2 + FMA ones
    assert kernels.simd_tiles() == ("avx512f" in flags or {"avx2", "fma"} <= set(flags))
    assert kernels.tile_lanes() == (16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= set(flags) else 0)


class _WithoutSimd:
    """The real kernels, reporting portable tiles only (a CPU with neither AVX-512 nor AVX2)."""

    def __init__(self, ops) -> None:
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def simd_tiles(self) -> bool:
        return False


def test_without_simd_tiles_weights_stay_fp32(kernels, monkeypatch):
    # The portable loops are slower than MKL's fp32 GEMM: such a CPU keeps the fp32 layers.
    monkeypatch.setitem(cpu_kernels._state, "ops", _WithoutSimd(kernels))
    model = _TiedLM()
    stats = prepack_linears_(model)
    assert stats["bf16"] == 0
    assert not any(isinstance(m, Bf16Linear) for m in model.modules())
    # nor the C++ GEMM's panels, whatever the probe found
    assert stats["panel"] == 0 and not any(isinstance(m, PanelLinear) for m in model.modules())


# -- bf16 in and out: Bf16Linear.for_bf16 (a model run in bf16) ----------------------------------------------------
# (K, N) for AMX's blocks: K a multiple of its 32-input step (one step, SmolLM2's 18, Qwen3.5's 112 in slices of 19),
# partial panels, and an output of 8 MiB from 256 rows on (written with non-temporal stores)
AMX_SHAPES = [(32, 16), (576, 96), (3584, 70), (64, 16384)]
# one and two blocks of 16 rows (one / two A tiles), a last block of each height, the row chunk
AMX_ROWS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 64, 100, 256, 300]


@pytest.mark.parametrize("k,n,row_counts",
                         [(k, n, ROWS) for k, n in SHAPES] + [(k, n, AMX_ROWS) for k, n in AMX_SHAPES])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("op", ["bf16_linear_bf16x", "bf16_linear_bf16x_dot"])  # AMX where it runs / vdpbf16ps only
def test_bf16x_kernel_is_the_fp32_product_of_bf16_inputs(kernels, k, n, row_counts, bias, op):
    layer = _bf16_valued_linear(k, n, bias)
    packed = pack_bf16(layer.weight.detach())
    for rows in row_counts:
        x = torch.randn(rows, k).bfloat16()
        # vdpbf16ps's and AMX's products of two bf16 values are exact in fp32 and summed in fp32, as the fp32 kernel's
        out = getattr(kernels, op)(x, packed, n, layer.bias, False)
        assert_fp32_product(out, x.float(), layer)
        # bf16_out: those sums, rounded to nearest (even) bf16 in the kernel
        assert torch.equal(getattr(kernels, op)(x, packed, n, layer.bias, True), out.bfloat16())


def test_bf16x_kernel_reports_vdpbf16ps_as_the_cpu_has_it_and_rejects_bad_inputs(kernels):
    flags = cpu_flags()
    assert kernels.bf16_dot() == ("avx512_bf16" in flags and "avx512f" in flags)  # built with -march=native
    packed = pack_bf16(_bf16_valued_linear(64, 40, False).weight.detach())
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        kernels.bf16_linear_bf16x(torch.randn(3, 64), packed, 40, None, True)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        kernels.bf16_linear_bf16x(torch.randn(3, 32).bfloat16(), packed, 40, None, True)
    with pytest.raises(RuntimeError, match="n=70 does not match 2 panels"):
        kernels.bf16_linear_bf16x(torch.randn(3, 64).bfloat16(), packed, 70, None, True)


def test_amx_is_used_as_the_cpu_has_it_and_a_row_sums_alike_in_any_batch_with_a_bf16_dot(kernels):
    flags = cpu_flags()
    assert kernels.bf16_amx() == ({"amx_bf16", "amx_tile", "avx512_bf16"} <= flags)  # built with -march=native
    # 1024 inputs: AMX's blocks take them in two slices from 97 rows on, and 256 rows or more of 8192 fp32 outputs are
    # written with non-temporal stores; up to 96 rows each block takes all 1024 inputs at once
    layer = _bf16_valued_linear(1024, 8192, False)
    packed = pack_bf16(layer.weight.detach())
    x = torch.randn(300, 1024).bfloat16()
    whole = kernels.bf16_linear_bf16x(x, packed, 8192, None, False)
    for rows in (1, 7, 8, 33, 97, 256):
        part = kernels.bf16_linear_bf16x(x[:rows], packed, 8192, None, False)
        if kernels.bf16_dot():
            # every batch size on the same tiles: a row's sums are the same bits alone, in a small batch or a large one
            assert torch.equal(part, whole[:rows]), rows
        else:
            # no AVX512-BF16: x widened to fp32 on the fp32-x kernel, whose tiles for 1-6 and 7-12 rows sum in
            # different orders (so no batch invariance there), each exactly bf16_linear's
            assert torch.equal(part, kernels.bf16_linear(x[:rows].float(), packed, 8192, None)), rows
    if kernels.bf16_amx():  # AMX sums in another order than the vdpbf16ps tile (the last bits differ)
        assert not torch.equal(kernels.bf16_linear_bf16x_dot(x, packed, 8192, None, False), whole)


class _Bf16LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 32)
        self.proj = nn.Linear(32, 48)
        self.odd = nn.Linear(31, 32)  # odd in_features: the kernel takes pairs
        self.lm_head = nn.Linear(32, 100, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        self.to(torch.bfloat16)


def test_prepack_gives_bf16_layers_the_kernel_for_every_batch(kernels, caplog):
    model = _Bf16LM()
    table = model.embed_tokens.weight.detach().clone()
    proj = nn.Linear(32, 48).double()
    proj.load_state_dict(model.proj.state_dict())
    with caplog.at_level(logging.INFO):
        stats = prepack_linears_(model)
    assert isinstance(model.proj, Bf16Linear) and isinstance(model.lm_head, Bf16Linear)
    assert type(model.odd) is nn.Linear and model.odd.weight.dtype == torch.bfloat16
    assert stats["bf16_io"] == 2 and stats["bf16"] == 0 and stats["bf16_io_bytes"] == (64 * 32 + 128 * 32) * 2
    assert "2 bf16 linear layers kept as bf16 panels" in caplog.text
    assert torch.equal(model.embed_tokens.weight, table)  # the embedding keeps its bf16 table
    assert torch.equal(model.lm_head.packed, pack_bf16(table))  # and the tied lm_head has its own panels
    recording = _Recording(kernels)
    model.proj.kernels = recording
    for rows in (1, 7, compact_linear.BF16_KERNEL_MAX_ROWS + 1, 700):
        x = torch.randn(rows, 32).bfloat16()
        out = model.proj(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 48)
        ref = proj(x.double())
        # the fp32 sums rounded to bf16 once: within a bf16 rounding (2^-8 relative) of the exact product
        scale = F.linear(x.double().abs(), proj.weight.abs(), proj.bias.abs())
        assert ((out.double() - ref).abs() <= 2.0 ** -8 * scale + 1e-6).all()
    assert recording.calls == ["bf16_linear_bf16x"] * 4
    x = torch.randn(2, 3, 32).bfloat16()[:, ::2]  # leading dims flattened; a non-contiguous input is copied
    assert torch.equal(model.proj(x).reshape(-1, 48), model.proj(x.reshape(-1, 32)))
    assert "bf16 in and out" in repr(model.proj)
    logits = model.lm_head(torch.randn(3, 32).bfloat16())  # the lm_head keeps its fp32 sums: fp32 logits
    assert logits.dtype == torch.float32 and logits.shape == (3, 100)


@pytest.mark.parametrize("k,n", [(32, 7), (64, 100), (576, 1000), (1024, 4099)])
def test_fused_argmax_is_argmax_rows_of_the_fp32_outputs(kernels, k, n):
    if not (kernels.bf16_amx() or kernels.bf16_dot()):
        pytest.skip("bf16_linear_argmax multiplies on AMX or vdpbf16ps only")
    from ascendserve.worker.sampler import argmax_rows
    weight = _bf16_valued_linear(k, n, False).weight.detach().clone()
    # equal outputs in other panels (and so on the other thread): a copy of row 3 at the last column, and of the last
    # panel's first row at column 0; the first index must win
    weight[n - 1] = weight[3]
    weight[0] = weight[(n - 1) // 32 * 32]
    packed = pack_bf16(weight)
    for rows in (1, 7, 33, 64, 100, 300):
        x = torch.randn(rows, k).bfloat16()
        x[rows // 2] = x[0]  # a repeated row: the same pick
        got = kernels.bf16_linear_argmax(x, packed, n)
        expected = argmax_rows(kernels.bf16_linear_bf16x(x, packed, n, None, False))
        assert got.dtype == torch.int64 and torch.equal(got, expected), rows
    # rows where the maximum is a tie between column 3 and column n - 1: x along row 3's weights
    x = (weight[3].float() * 4).bfloat16().repeat(5, 1)
    assert torch.equal(kernels.bf16_linear_argmax(x, packed, n), torch.full((5,), 3))
    # NaN: a row of NaN inputs gives NaN everywhere (index 0); a NaN weight row makes its column every row's pick,
    # before any larger value after it and after any larger value before it
    x = torch.randn(4, k).bfloat16()
    x[2] = float("nan")
    assert kernels.bf16_linear_argmax(x, packed, n).tolist()[2] == 0
    nan_weight = weight.clone()
    nan_weight[n // 2] = float("nan")
    got = kernels.bf16_linear_argmax(x, pack_bf16(nan_weight), n)
    assert got.tolist() == [n // 2, n // 2, 0, n // 2]  # row 2 is NaN from column 0 on
    assert torch.equal(got, argmax_rows(kernels.bf16_linear_bf16x(x, pack_bf16(nan_weight), n, None, False)))


def test_fused_argmax_rejects_bad_inputs(kernels):
    packed = pack_bf16(_bf16_valued_linear(64, 40, False).weight.detach())
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        kernels.bf16_linear_argmax(torch.randn(3, 64), packed, 40)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        kernels.bf16_linear_argmax(torch.randn(3, 32).bfloat16(), packed, 40)
    if not (kernels.bf16_amx() or kernels.bf16_dot()):
        with pytest.raises(RuntimeError, match="needs AMX"):
            kernels.bf16_linear_argmax(torch.randn(3, 64).bfloat16(), packed, 40)


# (rows, K, I) for the fused gate-and-up layer: one and two A tiles, last blocks of each height, K in one, two and
# several slices (the demo's 576, Qwen3.5's 1024, 3584), and outputs of 8 MiB or more (non-temporal stores); on the
# vdpbf16ps tile, row blocks of 12 and the last ones of each height, and a K that is not a multiple of 32 (that tile
# also on a CPU with AMX)
GATE_UP_CASES = [(1, 576, 1536), (5, 64, 32), (17, 576, 96), (33, 1024, 3584), (64, 576, 1536), (300, 3584, 64),
                 (1200, 576, 3584), (1100, 576, 512), (13, 98, 64), (29, 50, 32)]


@pytest.mark.parametrize("rows,k,i", GATE_UP_CASES)
def test_fused_gate_up_silu_is_the_linear_then_silu_and_mul_bit_for_bit(kernels, rows, k, i):
    if not (kernels.bf16_amx() or kernels.bf16_dot()):
        pytest.skip("bf16_linear_silu_mul multiplies on AMX or AVX512-BF16 only")
    gen = torch.Generator().manual_seed(rows + k + i)
    weight = (torch.randn(2 * i, k, generator=gen) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    unfused = kernels.silu_and_mul(kernels.bf16_linear_bf16x(x, pack_bf16(weight), 2 * i, None, True))
    fused = kernels.bf16_linear_silu_mul(x, pack_gate_up(weight), i)
    assert fused.dtype == torch.bfloat16 and fused.shape == (rows, i)
    assert torch.equal(fused, unfused)
    # and against torch: silu(gate) * up in fp64 of the layer's bf16 products (the linear is checked against exact
    # products above), within the output's bf16 rounding
    gate_up = kernels.bf16_linear_bf16x(x, pack_bf16(weight), 2 * i, None, True).double()
    ref = F.silu(gate_up[:, :i]) * gate_up[:, i:]
    assert ((fused.double() - ref).abs() <= 2.0 ** -8 * ref.abs() + 1e-30).all()


def test_pack_gate_up_pairs_the_gate_and_up_panels():
    weight = torch.arange(128 * 4, dtype=torch.float32).reshape(128, 4).bfloat16()  # I = 64: two panel pairs
    panels = pack_bf16(weight)
    assert torch.equal(pack_gate_up(weight), torch.stack([panels[0], panels[2], panels[1], panels[3]]))


def test_fused_gate_up_silu_rejects_bad_inputs(kernels):
    packed = pack_gate_up(torch.zeros(128, 64).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        kernels.bf16_linear_silu_mul(torch.zeros(3, 64), packed, 64)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        kernels.bf16_linear_silu_mul(torch.zeros(3, 32).bfloat16(), packed, 64)
    with pytest.raises(RuntimeError, match="n=48 must be a multiple of 32"):
        kernels.bf16_linear_silu_mul(torch.zeros(3, 64).bfloat16(), packed, 48)
    if not (kernels.bf16_amx() or kernels.bf16_dot()):
        with pytest.raises(RuntimeError, match="needs AMX"):
            kernels.bf16_linear_silu_mul(torch.zeros(3, 64).bfloat16(), packed, 64)


class _Bf16MLP(nn.Module):
    def __init__(self, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(64, 2 * 96, bias=bias)
        self.down_proj = nn.Linear(96, 64, bias=False)
        self.act = GatedActivation(act)
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def test_prepack_fuses_a_silu_mlp_gate_up_with_the_same_outputs(kernels, caplog):
    model = _Bf16MLP()
    gate_up = model.gate_up_proj.weight.detach().clone()
    with caplog.at_level(logging.INFO):
        stats = prepack_linears_(model)
    fused = bool(kernels.bf16_amx() or kernels.bf16_dot())
    assert isinstance(model.gate_up_proj, Bf16GateUpSilu if fused else Bf16Linear)
    assert isinstance(model.act, nn.Identity if fused else GatedActivation)
    assert stats["gate_up_silu"] == fused and stats["bf16_io"] == 2
    assert ("MLP gate-and-up layers that also apply SiLU-and-mul" in caplog.text) == fused
    for rows in (1, 40, 300):
        x = torch.randn(2, rows, 64).bfloat16()  # leading dims as the model's
        unfused = kernels.silu_and_mul(kernels.bf16_linear_bf16x(x.reshape(-1, 64), pack_bf16(gate_up), 192, None,
                                                                 True))
        assert torch.equal(model(x).reshape(-1, 64), model.down_proj(unfused))
    if fused:
        assert "bf16 gate / up panel pairs" in repr(model.gate_up_proj)


def test_prepack_keeps_other_activations_and_biased_gate_ups_unfused(kernels):
    for model in (_Bf16MLP("gelu"), _Bf16MLP(bias=True)):
        prepack_linears_(model)
        assert isinstance(model.gate_up_proj, Bf16Linear) and isinstance(model.act, GatedActivation)


def test_bf16_layers_keep_torch_gemm_when_turned_off(monkeypatch):
    monkeypatch.setenv(compact_linear.COMPACT_ENV_VAR, "0")
    model = _Bf16LM()
    stats = prepack_linears_(model)
    assert stats["bf16_io"] == 0 and not any(isinstance(m, Bf16Linear) for m in model.modules())
