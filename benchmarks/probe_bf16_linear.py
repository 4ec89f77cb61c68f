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
Variants are interleaved round by round; each call uses the next of several weight copies (over
--stream-mib in all) so weights come from DRAM as in a decode step. Median of --rounds. The host is
shared: run it twice.

    .venv/bin/python benchmarks/probe_bf16_linear.py [--shapes smol|qwen|all] [--rows 1,8,64,256,2048]
        [--rounds 9] [--threads N] [--stream-mib 256] [--variants fp32,mkl-pack,bf16,unpack+F,native,bf16x,dot]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ascendserve.layers import cpu_kernels
from ascendserve.layers.compact_linear import pack_bf16
from probe_packed_linear import SHAPES  # this directory is on sys.path when run as a script

MKL_MAX_ROWS = 128


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
        for rows in rows_list:
            x = torch.randn(rows, k)
            xb = x.bfloat16()
            variants = {
                "fp32": lambda i: F.linear(x, weights[i]),
                "mkl-pack": (lambda i: torch.ops.mkl._mkl_linear(x, mkl[i], weights[i], None, rows))
                if rows <= MKL_MAX_ROWS else None,
                "bf16": lambda i: ops.bf16_linear(x, packs[i], n, None),
                "unpack+F": lambda i: F.linear(x, ops.bf16_unpack(packs[i], n)),
                "native": lambda i: F.linear(xb, natives[i]),
                "bf16x": lambda i: ops.bf16_linear_bf16x(xb, packs[i], n, None, True),
                "dot": lambda i: ops.bf16_linear_bf16x_dot(xb, packs[i], n, None, True),
            }
            times = {name: [] for name in chosen if variants[name] is not None}
            for r in range(args.rounds + 1):
                for name in times:
                    start = time.perf_counter()
                    variants[name](r % copies)
                    if r:  # round 0 warms up
                        times[name].append((time.perf_counter() - start) * 1e3)
            med = {name: statistics.median(t) for name, t in times.items()}
            cells = [f"{med[name]:9.2f}" if name in med else f"{'-':>9}" for name in chosen]
            print(f"{label:22} {f'{n} x {k}':>14} {rows:>5} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
