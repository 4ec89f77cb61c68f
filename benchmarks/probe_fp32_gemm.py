"""The fp32 GEMMs a CPU linear can take, per layer shape and batch size: GFLOP/s of MKL's (F.linear, and its packs
made for 64 rows and for the batch), oneDNN's (plain and on a weight reordered for the batch) and the panel kernel's
(csrc/f32_linear_cpu.cpp); the variants interleaved call by call, median of 7 calls after a warm-up. It shows which
GEMM prefill-sized batches should take (linear.large_batch_gemm probes one shape at start-up).

    .venv/bin/python benchmarks/probe_fp32_gemm.py --shapes smol --rows 2048,512
    .venv/bin/python benchmarks/probe_fp32_gemm.py --shapes qwen --rows 2048,512
"""

import argparse
import time

import torch
import torch.nn.functional as F

from ascendserve.layers.compact_linear import tile_kernels

SHAPES = {  # name: (out_features, in_features)
    "smol": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
    "qwen": {"qkvz": (8192, 1024), "ba": (32, 1024), "out": (1024, 2048), "gate_up": (7168, 1024),
             "down": (1024, 3584)},
}


def variants(weight: torch.Tensor, rows: int) -> dict:
    n = weight.shape[0]
    found = {"mkl": lambda x: F.linear(x, weight),
             "onednn": lambda x: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")}
    reordered = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    found["onednn reordered"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], "")
    pack64 = torch.ops.mkl._mkl_reorder_linear_weight(weight, 64)
    found["mkl pack64"] = lambda x: torch.ops.mkl._mkl_linear(x, pack64, weight, None, x.shape[0])
    pack_m = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    found["mkl pack-M"] = lambda x: torch.ops.mkl._mkl_linear(x, pack_m, weight, None, x.shape[0])
    if (kernels := tile_kernels()) is not None:
        panels = kernels.f32_pack(weight)
        found["panel"] = lambda x: kernels.f32_linear(x, panels, n, None)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smol")
    ap.add_argument("--rows", default="2048,512")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for rows in map(int, args.rows.split(",")):
        totals: dict[str, float] = {}
        print(f"\n{rows} rows: GFLOP/s per layer, then ms for all")
        for name, (n, k) in SHAPES[args.shapes].items():
            weight, x = torch.randn(n, k) * 0.02, torch.randn(rows, k)
            gemms = variants(weight, rows)
            times: dict[str, list[float]] = {v: [] for v in gemms}
            for rep in range(8):
                for v, gemm in gemms.items():
                    start = time.perf_counter()
                    gemm(x)
                    if rep:
                        times[v].append(time.perf_counter() - start)
            medians = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
            for v, t in medians.items():
                totals[v] = totals.get(v, 0.0) + t
            print(f"| {name} {n}x{k} | " + " | ".join(f"{v} {2 * rows * n * k / t / 1e9:.0f}"
                                                     for v, t in medians.items()) + " |")
        print("| all (ms) | " + " | ".join(f"{v} {t * 1e3:.1f}" for v, t in totals.items()) + " |")


if __name__ == "__main__":
    main()
