"""The 4-bit-weight linears on the demo's shapes, ms per call (median of repeats, weights warm): the fp32 4-bit
kernel (q4_linear), the int8-activation one (q4_a8_linear, `--activation-quantization int8`), and oneDNN's fp32
GEMM on the dense weight (what an fp32 layer runs at these sizes), with the int8 kernel's GFLOP/s.

    .venv/bin/python benchmarks/probe_a8_linear.py [--rows 2,16,64,256,2048] [--repeats 20]
"""

import argparse
import time

import torch
import torch.nn.functional as F

from ascendserve.layers import cpu_kernels
from ascendserve.layers.compact_linear import pack_q4

SHAPES = [("gate_up", 3072, 576), ("down", 576, 1536), ("o_proj", 576, 576), ("qkv", 960, 576)]


def _ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2,16,64,256,2048")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    ops = cpu_kernels.ops()
    if ops is None:
        raise SystemExit("the CPU kernels did not build")
    torch.manual_seed(0)
    tile = ops.q4_a8_tile() if hasattr(ops, "q4_a8_tile") else "avx2 (a build before q4_a8_tile)"
    print(f"threads {torch.get_num_threads()}; int8-x tile: {tile}")
    print(f"| shape (N x K) | rows | q4 fp32 ms | q4 int8-x ms | onednn fp32 ms | int8-x GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        d, m = torch.rand(n, k // 32) * 0.01, -torch.rand(n, k // 32) * 0.05
        packed = pack_q4(q, d, m)
        dense = (d.repeat_interleave(32, 1) * q.float() + m.repeat_interleave(32, 1)).contiguous()
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            fp32 = _ms(lambda: ops.q4_linear(x, *packed, n, None), args.repeats) if rows <= 256 else float("nan")
            a8 = _ms(lambda: ops.q4_a8_linear(x, *packed, n, None), args.repeats)
            with torch.no_grad():
                ref = _ms(lambda: F.linear(x, dense), args.repeats)
            print(f"| {name} {n}x{k} | {rows} | {fp32:.3f} | {a8:.3f} | {ref:.3f} | {2e-6 * rows * n * k / a8:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
