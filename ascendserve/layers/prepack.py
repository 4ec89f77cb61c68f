"""Once a model's weights are loaded, each fp32 CPU layer gets the form that computes the same products
fastest (compact_linear.py's bf16 / 4-bit / 8-bit copies, linear.py's MKL pack or oneDNN GEMM):
prepack_linears_ for the linear layers, compact_embeddings_ for the token embedding."""

import torch
import torch.nn.functional as F
from torch import nn

from ascendserve.config import env_switch
from ascendserve.layers import linear
from ascendserve.layers.activation import GatedActivation
from ascendserve.layers.compact_linear import (COMPACT_ENV_VAR, Q4_GROUP, Q4_KERNEL_MAX_ROWS, Q8_GROUP,
                                               Q8_KERNEL_MAX_ROWS, Bf16Embedding, Bf16GateUpSilu, Bf16Linear,
                                               Q4Linear, Q8Linear,
                                               a8_tile_name, bf16_kernel_for_large_batches, bf16_valued, find_q4_grid,
                                               find_q8_grid, tile_kernels)
from ascendserve.logger import init_logger

logger = init_logger(__name__)

STAT_KEYS = ("packed", "weight_bytes", "pack_bytes", "padded", "bf16", "bf16_bytes", "bf16_io", "bf16_io_bytes",
             "gate_up_silu", "q4", "q4_bytes", "q8", "q8_bytes", "onednn", "panel", "panel_bytes", "int8_activations")


def prepack_linears_(model: nn.Module, int8_activations: bool = False) -> dict[str, int]:
    """Replace the model's fp32 and bf16 CPU nn.Linear layers in place; returns counts and bytes.

    All bf16 values -> Bf16Linear. Else, by the fp32 GEMM that probed the fastest (linear.fp32_gemm), PanelLinear
    (the C++ kernel's panels), DenseLinear (oneDNN's GEMM) or PackedLinear (MKL's packed GEMM, unless
    ASCENDSERVE_PACKED_LINEAR=0),
    wrapped in a Q4Linear for small batches when the values are a 4-bit grid per 32 inputs (a
    dequantized Q4_0 / Q4_1 GGUF), or in a Q8Linear when they are an 8-bit one (Q8_0). Bf16Linear,
    Q4Linear and Q8Linear need the CPU kernels and ASCENDSERVE_COMPACT_WEIGHTS not 0. int8_activations: the
    Q4Linear layers multiply int8-rounded activations (Q4Panels; counted as "int8_activations") and keep no fp32
    layer beneath (their kernels take every batch). bf16 layers (a model run in bf16) -> Bf16Linear.for_bf16
    (counted as "bf16_io"), where the kernels build and ASCENDSERVE_COMPACT_WEIGHTS is not 0 (the lm_head and the
    layers a module names in its `fp32_output_linears` return their fp32 sums unrounded). A no-op (zeros)
    where none applies, e.g. non-CPU layers (the GEMM probe then does not run either). Call after
    the weights are loaded.
    """
    stats = dict.fromkeys(STAT_KEYS, 0)
    any_rows_by_shape: dict[tuple[int, int], bool] = {}
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and linear.PackedLinear.supports(child):
                    layer = _cpu_form(child, int8_activations, stats, any_rows_by_shape)
                    if layer is not child:
                        setattr(parent, name, layer)
                elif isinstance(child, nn.Linear) and Bf16Linear.supports_bf16(child) and (kernels := _kernels()):
                    if _silu_after(parent, name) and Bf16GateUpSilu.supports(child, kernels):
                        layer = Bf16GateUpSilu(child, kernels)
                        parent.act = nn.Identity()  # the layer returns silu(gate) * up
                        stats["gate_up_silu"] += 1
                    else:
                        fp32_out = name == "lm_head" or name in getattr(parent, "fp32_output_linears", ())
                        layer = Bf16Linear.for_bf16(child, kernels, fp32_out=fp32_out)
                    _count(stats, "bf16_io", layer.packed.numel() * 2)
                    setattr(parent, name, layer)
    _log_linears(stats)
    # the fp32 forms (also beneath q4 / q8) and the bf16 ones that widen large batches take the large probe's GEMM
    widened_bf16 = stats["bf16"] and not bf16_kernel_for_large_batches()
    if widened_bf16 or any(stats[kind] for kind in ("packed", "onednn", "panel")):
        _log_large_batches()
    return stats


def _log_large_batches() -> None:
    """Probe the prefill-sized GEMM at load (not at the first large batch, a request's) and say what it picked."""
    small, large = linear.fp32_gemm(), linear.large_batch_gemm()
    if not small == large == "panel":  # only PanelLinear layers hold panels; the rest take dense_linear
        large = "onednn" if linear.onednn_gemm_faster(linear.LARGE_ROWS) else "mkl"
    if large != small:
        logger.info("fp32 batches of %d rows or more multiply with the %s GEMM (smaller batches: %s)",
                    linear.LARGE_ROWS, large, small)


def _cpu_form(child: nn.Linear, int8_activations: bool, stats: dict[str, int],
              any_rows_by_shape: dict[tuple[int, int], bool]) -> nn.Module:
    """What one fp32 CPU nn.Linear becomes (see prepack_linears_), counted in stats."""
    kernels = _kernels()
    if kernels is not None and Bf16Linear.supports(child):
        layer = Bf16Linear(child, kernels)
        _count(stats, "bf16", layer.packed.numel() * 2)
        return layer
    grid4 = find_q4_grid(child.weight.detach()) if kernels is not None else None
    if grid4 is not None and int8_activations:  # the kernels take every batch: no fp32 layer beneath
        layer = Q4Linear(child, grid4, kernels)
        layer.use_int8_activations()
        stats["int8_activations"] += 1
        _count(stats, "q4", layer.q4_bytes())
        return layer
    layer = _fp32_form(child, stats, any_rows_by_shape)
    if grid4 is not None:
        layer = Q4Linear(layer, grid4, kernels)
        _count(stats, "q4", layer.q4_bytes())
    elif kernels is not None and (grid8 := find_q8_grid(child.weight.detach())) is not None:
        layer = Q8Linear(layer, grid8, kernels)
        _count(stats, "q8", sum(t.numel() * t.element_size() for t in (layer.q, layer.scales)))
    return layer


def _silu_after(parent: nn.Module, name: str) -> bool:
    """Whether parent.<name> is a gated MLP's gate_up_proj followed by a SiLU GatedActivation in parent.act (LlamaMLP,
    Qwen3.5's GatedMLP): down_proj(act(gate_up_proj(x)))."""
    act = getattr(parent, "act", None)
    return name == "gate_up_proj" and isinstance(act, GatedActivation) and act.act is F.silu


def _kernels():
    """The CPU kernels for the compact layers, None where they did not build or ASCENDSERVE_COMPACT_WEIGHTS=0."""
    return tile_kernels() if env_switch(COMPACT_ENV_VAR) is not False else None


def _fp32_form(child: nn.Linear, stats: dict[str, int], any_rows_by_shape: dict[tuple[int, int], bool]) -> nn.Module:
    """PanelLinear or DenseLinear where the C++ kernel's or oneDNN's GEMM is the fastest, else PackedLinear where
    MKL packs, else the layer itself."""
    gemm = linear.fp32_gemm()  # probed once: here, or at a bf16 layer's first large batch
    if gemm == "panel":
        layer = linear.PanelLinear(child, tile_kernels())
        _count(stats, "panel", layer.pack_bytes())
        return layer
    if gemm == "onednn":
        stats["onednn"] += 1
        return linear.DenseLinear(child)
    if not linear.packing_supported():
        return child
    shape = tuple(child.weight.shape)
    layer = linear.PackedLinear(child, any_rows_by_shape.get(shape))
    any_rows_by_shape[shape] = layer.any_rows
    stats["packed"] += 1
    stats["padded"] += not layer.any_rows
    stats["weight_bytes"] += child.weight.numel() * child.weight.element_size()
    stats["pack_bytes"] += layer.pack_bytes()
    return layer


def _count(stats: dict[str, int], kind: str, nbytes: int) -> None:
    stats[kind] += 1
    stats[f"{kind}_bytes"] += nbytes


def _log_linears(stats: dict[str, int]) -> None:
    if stats["bf16"]:
        logger.info("%d fp32 linear layers hold bf16 values (a bf16 checkpoint): kept as bf16 (%.1f MiB, half "
                    "the fp32 size) and multiplied in fp32 by the CPU kernel; %s=0 keeps them fp32",
                    stats["bf16"], stats["bf16_bytes"] / 2**20, COMPACT_ENV_VAR)
    if stats["bf16_io"]:
        kernels = _kernels()
        how = "with vdpbf16ps (AVX512-BF16)" if kernels.bf16_dot() else "with x widened to fp32 (no AVX512-BF16 here)"
        if kernels.bf16_amx():
            how = "on AMX tiles (K a multiple of 32; else " + how + ")"
        logger.info("%d bf16 linear layers kept as bf16 panels (%.1f MiB) for the CPU kernel, which multiplies them %s "
                    "and rounds the fp32 sums to bf16 (the lm_head keeps them: fp32 logits); %s=0 keeps torch's bf16 "
                    "GEMM", stats["bf16_io"], stats["bf16_io_bytes"] / 2**20, how, COMPACT_ENV_VAR)
        if stats["gate_up_silu"]:
            logger.info("%d of them are MLP gate-and-up layers that also apply SiLU-and-mul in the same op",
                        stats["gate_up_silu"])
    if stats["int8_activations"]:
        logger.info("%d fp32 linear layers hold a 4-bit grid per %d inputs (a Q4_0 / Q4_1 GGUF): kept as 4-bit "
                    "only (%.1f MiB, the fp32 weights released), multiplied with int8 activations (%s) in batches of "
                    "2 rows or more (--activation-quantization int8, not bit-exact), in fp32 at one row",
                    stats["q4"], Q4_GROUP, stats["q4_bytes"] / 2**20, a8_tile_name(_kernels()))
    elif stats["q4"]:
        logger.info("%d fp32 linear layers hold a 4-bit grid per %d inputs (a Q4_0 / Q4_1 GGUF): also kept as "
                    "4-bit (%.1f MiB more) for batches of up to %d rows, multiplied in fp32 by the CPU kernel; "
                    "%s=0 turns this off", stats["q4"], Q4_GROUP, stats["q4_bytes"] / 2**20, Q4_KERNEL_MAX_ROWS,
                    COMPACT_ENV_VAR)
    if stats["q8"]:
        logger.info("%d fp32 linear layers hold an 8-bit grid per %d inputs (Q8_0 GGUF tensors): also kept as "
                    "8-bit (%.1f MiB more) for batches of up to %d rows, multiplied in fp32 by the CPU kernel; "
                    "%s=0 turns this off", stats["q8"], Q8_GROUP, stats["q8_bytes"] / 2**20, Q8_KERNEL_MAX_ROWS,
                    COMPACT_ENV_VAR)
    if stats["panel"]:
        logger.info("%d fp32 linear layers also kept as panels for the C++ GEMM (the fastest here; %.1f MiB more "
                    "memory); %s=onednn|mkl picks another", stats["panel"], stats["panel_bytes"] / 2**20,
                    linear.FP32_GEMM_ENV_VAR)
    if stats["packed"]:
        low, high = linear.MIN_PACKED_ROWS, linear.PACK_ROWS if stats["padded"] else linear.MAX_PACKED_ROWS
        rows = f"{low}..{high} rows" + (f" padded to {high} on {stats['padded']} layers (this MKL needs it)"
                                        if stats["padded"] else "")
        logger.info("MKL-packed %d fp32 linear layers for batches of %s (F.linear outside): about %.1f MiB "
                    "more memory (%.1f MiB reserved); ASCENDSERVE_PACKED_LINEAR=0 turns this off",
                    stats["packed"], rows, stats["weight_bytes"] / 2**20, stats["pack_bytes"] / 2**20)


def compact_embeddings_(model: nn.Module) -> int:
    """Replace the model's fp32 CPU nn.Embedding layers whose values are all bf16 by Bf16Embedding, in place,
    where no other layer holds the same weight (a tied lm_head that stayed fp32 would keep it alive, and the
    bf16 copy would add memory); returns the bytes freed. Qwen3.5-0.8B's 248320 x 1024 table, tied to an
    lm_head that prepack_linears_ keeps as bf16 panels (or --quantization int4 as 4-bit): 1017 -> 509 MB.
    A no-op where ASCENDSERVE_COMPACT_WEIGHTS=0. Call after prepack_linears_ / quantize_model_."""
    if env_switch(COMPACT_ENV_VAR) is False:
        return 0
    embeddings = [(parent, name, child) for parent in list(model.modules())
                  for name, child in parent.named_children() if type(child) is nn.Embedding]
    tables = {child.weight.data_ptr() for _, _, child in embeddings}
    held_elsewhere = {t.data_ptr() for module in model.modules() if type(module) is not nn.Embedding
                      for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]} & tables
    freed = 0
    with torch.no_grad():
        for parent, name, child in embeddings:
            weight = child.weight
            if (weight.dtype != torch.float32 or weight.device.type != "cpu" or child.max_norm is not None
                    or weight.data_ptr() in held_elsewhere or not bf16_valued(weight)):
                continue
            setattr(parent, name, Bf16Embedding(child))
            freed += weight.numel() * 2
    if freed:
        logger.info("The token embedding holds bf16 values (a bf16 checkpoint): kept as bf16 (%.1f MiB freed); "
                    "%s=0 keeps it fp32", freed / 2**20, COMPACT_ENV_VAR)
    return freed

