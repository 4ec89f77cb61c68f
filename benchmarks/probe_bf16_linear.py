"""Probe the bf16-weight / fp32-compute CPU kernel against fp32 F.linear and MKL's packed fp32 GEMM.

Variants per (shape, M rows), ms per call:
  fp32      F.linear(x, W) with W fp32
  mkl-pack  torch.ops.mkl._mkl_linear on a pack made for 64 rows (PackedLinear, M <= 128 only)
  bf16      torch.ops.ascendserve_cpu.bf16_linear on W held as bf16 panels (Bf16Linear, M <= 256)
  unpack+F  bf16_unpack to fp32, then F.linear (Bf16Linear above 256 rows)
  native    F.linear on bf16 x and W (torch's bf16 GEMM: oneDNN, AVX512-BF16 / AMX where the CPU has it)
  bf16x     torch.ops.ascendserve_cpu.bf16_linear_bf16x on bf16 x and the panels (what `--dtype bfloat16` runs:
            Bf16Linear.for_bf16; AMX where the CPU has it, else vdpbf16ps where it has AVX512-BF16), output
            rounded to bf16
  dot       bf16_linear_bf16x_dot: the same on the vdpbf16ps tile at every batch size (what bf16x was before AMX)
  q4        torch.ops.ascendserve_cpu.q4_linear on fp32 x and the weight on a 4-bit grid per 64 inputs
            (`--quantization int4` in an fp32 model: GridInt4Linear)
  q4bf16x   q4_linear_bf16x on bf16 x and the same 4-bit panels, output rounded to bf16 (`--quantization int4` in
            a bf16 model)
  i4torch   torch._weight_int4pack_mm_for_cpu on bf16 x, group 64 (what a bf16 model's int4 layers ran before)
  q8        q8_linear on fp32 x and the weight on an 8-bit grid per 32 inputs (Q8_0's) (`--quantization int8` in an
            fp32 model: GridInt8Linear up to its INT8_GRID_KERNEL_MAX_ROWS)
  q8deq     the same weight dequantized to fp32 for the call, then F.linear (GridInt8Linear above those rows)
  q8bf16x   q8_linear_bf16x on bf16 x and the same 8-bit panels, output rounded to bf16 (`--quantization int8` in a
            bf16 model: GridInt8Linear)
  i8torch   torch._weight_int8pack_mm on bf16 x, per-channel bf16 scales (`--quantization int8` before GridInt8Linear)
  q8a8      q8_a8_linear on fp32 x and the same 8-bit panels, x rounded to int8 per 32 inputs (`--quantization int8
            --activation-quantization int8` from 16 rows, AVX512-VNNI)
Variants are interleaved round by round; each call uses the next of several weight copies (over
--stream-mib in all) so weights come from DRAM as in a decode step. Median of --rounds. The host is
shared: run it twice.

    .venv/bin/python benchmarks/probe_bf16_linear.py [--shapes smol|qwen|all] [--rows 1,8,64,256,2048]
        [--rounds 9] [--threads N] [--stream-mib 256]
        [--variants fp32,mkl-pack,bf16,unpack+F,native,bf16x,dot,q4,q4bf16x,i4torch,q8,q8deq,q8bf16x,
         i8torch,q8a8]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from ascendserve.layers import cpu_kernels
from ascendserve.layers.compact_linear import pack_bf16, pack_q4, round_to_grid
from ascendserve.layers.quantization import GridInt8Linear
from probe_packed_linear import SHAPES  # this directory is on sys.path when run as a script

MKL_MAX_ROWS = 128
Q4_GROUP = 64  # inputs per (d, m) block, as --quantization int4
Q4_VARIANTS = ("q4", "q4bf16x", "i4torch")
Q8_VARIANTS = ("q8", "q8deq", "q8bf16x", "i8torch", "q8a8")


def q4_forms(weight: torch.Tensor, need_torch: bool):
    """(the 4-bit panels, torch's int4 pack and bf16 scales or None) of a weight rounded to a grid per 64 inputs."""
    n, k = weight.shape
    blocks = weight.reshape(n, k // Q4_GROUP, Q4_GROUP)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = (hi - lo) / 15
    q = round_to_grid(blocks, d, lo).to(torch.uint8).reshape(n, k)
    panels = pack_q4(q, d, lo)
    if not need_torch or n % 16:
        return panels, None
    scales_zeros = torch.stack([d.t(), (lo + 8 * d).t()], dim=-1).contiguous().bfloat16()
    return panels, (torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2), scales_zeros)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="all", choices=["smol", "qwen", "all"])
    parser.add_argument("--rows", default="1,8,64,256,2048")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--stream-mib", type=float, default=256)
    parser.add_argument("--variants", default="fp32,mkl-pack,bf16,unpack+F,native,bf16x,dot",
                        help="comma-separated columns to time (see above)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = cpu_kernels.ops()
    if ops is None:
        raise SystemExit("the CPU kernels did not build (see the warning)")
    shapes = SHAPES["smol"] + SHAPES["qwen"] if args.shapes == "all" else SHAPES[args.shapes]
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"threads {torch.get_num_threads()}, median of {args.rounds} rounds, ms per call")
    chosen = args.variants.split(",")
    print(f"{'shape':22} {'N x K':>14} {'M':>5} " + " ".join(f"{name:>9}" for name in chosen))
    for label, n, k in shapes:
        copies = max(1, min(16, int(args.stream_mib * 2**20 // (n * k * 4))))
        weights = [torch.randn(n, k).bfloat16().float() for _ in range(copies)]
        packs = [pack_bf16(w) for w in weights]
        natives = [w.bfloat16() for w in weights]
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, 64) for w in weights]
        q4 = []
        if any(name in Q4_VARIANTS for name in chosen) and k % Q4_GROUP == 0:  # 8x the copies: 5/8 byte a weight
            q4_copies = max(1, min(64, int(args.stream_mib * 2**20 // (n * k * 5 / 8))))
            q4 = [q4_forms(weights[i % copies], "i4torch" in chosen) for i in range(q4_copies)]
        q8 = []
        if any(name in Q8_VARIANTS for name in chosen) and k % 32 == 0:  # 4x the copies: ~1 byte a weight
            q8_copies = max(1, min(64, int(args.stream_mib * 2**20 // (n * k))))
            for i in range(q8_copies):
                w = weights[i % copies]
                scales = w.abs().amax(1) / 127
                layer = nn.Linear(k, n, bias=False)
                layer.weight.data = w
                q8.append((GridInt8Linear(layer, ops, max_rows=0),
                           ((w / scales[:, None]).round().to(torch.int8), scales.bfloat16())))
        for rows in rows_list:
            x = torch.randn(rows, k)
            xb = x.bfloat16()
            variants = {
                "fp32": lambda i: F.linear(x, weights[i % copies]),
                "mkl-pack": (lambda i: torch.ops.mkl._mkl_linear(x, mkl[i % copies], weights[i % copies], None, rows))
                if rows <= MKL_MAX_ROWS else None,
                "bf16": lambda i: ops.bf16_linear(x, packs[i % copies], n, None),
                "unpack+F": lambda i: F.linear(x, ops.bf16_unpack(packs[i % copies], n)),
                "native": lambda i: F.linear(xb, natives[i % copies]),
                "bf16x": lambda i: ops.bf16_linear_bf16x(xb, packs[i % copies], n, None, True),
                "dot": lambda i: ops.bf16_linear_bf16x_dot(xb, packs[i % copies], n, None, True),
                "q4": (lambda i: ops.q4_linear(x, *q4[i % len(q4)][0], n, None)) if q4 else None,
                "q4bf16x": (lambda i: ops.q4_linear_bf16x(xb, *q4[i % len(q4)][0], n, None, True)) if q4 else None,
                "i4torch": (lambda i: torch._weight_int4pack_mm_for_cpu(xb, q4[i % len(q4)][1][0], Q4_GROUP,
                                                                        q4[i % len(q4)][1][1]))
                if q4 and q4[0][1] is not None else None,
                "q8": (lambda i: q8[i % len(q8)][0]._kernel(x)) if q8 else None,
                "q8deq": (lambda i: q8[i % len(q8)][0]._large(x)) if q8 else None,
                "q8bf16x": (lambda i: ops.q8_linear_bf16x(xb, q8[i % len(q8)][0].q, q8[i % len(q8)][0].scales, n, None,
                                                          True)) if q8 else None,
                "i8torch": (lambda i: torch._weight_int8pack_mm(xb, *q8[i % len(q8)][1])) if q8 else None,
                "q8a8": (lambda i: ops.q8_a8_linear(x, q8[i % len(q8)][0].q, q8[i % len(q8)][0].scales, n, None))
                if q8 else None,
            }
            times = {name: [] for name in chosen if variants[name] is not None}
            for r in range(args.rounds + 1):
                for name in times:
                    start = time.perf_counter()
                    variants[name](r)
                    if r:  # round 0 warms up
                        times[name].append((time.perf_counter() - start) * 1e3)
            med = {name: statistics.median(t) for name, t in times.items()}
            cells = [f"{med[name]:9.2f}" if name in med else f"{'-':>9}" for name in chosen]
            print(f"{label:22} {f'{n} x {k}':>14} {rows:>5} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
