"""Probe MKL's pre-packed fp32 GEMM against F.linear on the engine's real linear shapes (CPU).

`torch.ops.mkl._mkl_reorder_linear_weight(W, B)` packs W for batches of exactly B rows;
`torch.ops.mkl._mkl_linear(x, packed, W, bias, B)` uses the pack only when x has B rows (else it
falls back to F.linear on W). So a batch of M rows is run as:
  linear   F.linear(x, W)
  pB       M <= B: x zero-padded to B rows, one packed call, the first M output rows kept
  pB xC    M > B: C = ceil(M / B) packed calls on B-row chunks (the last one padded)
  aB       the pack made for B rows, called with the M rows as they are (no padding, no chunks):
           outside MKL's documented contract (pack and compute with the same m), checked below
Padding, slicing and concatenation are inside the timed call.

Timing: every variant of one (shape, M) is timed call by call, interleaved (the order rotates each
round), each call on the next of enough distinct weights (> --stream-mib) that weights stream from
DRAM as in a decode step; the table shows the median (or --stat min) ms per call. Run it twice: the
host is shared.

    .venv/bin/python benchmarks/probe_packed_linear.py [--shapes smol|qwen|all] [--rows 1,2,...]
        [--buckets 8,16,32,64] [--rounds 15] [--threads N] [--stream-mib 320] [--stat median|min] [--any 16]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name -> [(label, N out_features, K in_features)]
    "smol": [("smol qkv", 960, 576), ("smol o_proj", 576, 576), ("smol gate_up", 3072, 576),
             ("smol down", 576, 1536), ("smol lm_head", 49152, 576)],
    "qwen": [("q35 attn qkv", 5120, 1024), ("q35 o_proj/out_proj", 1024, 2048),
             ("q35 gdn in_proj_qkvz", 8192, 1024), ("q35 gdn in_proj_ba", 32, 1024),
             ("q35 gate_up", 7168, 1024), ("q35 down", 1024, 3584), ("q35 lm_head", 248320, 1024)],
}
MAX_CHUNKS = 4  # chunked variants only up to this many packed calls per batch
STATS = {"median": statistics.median, "min": min}
MAX_VARIANT_S = 1.0  # per (shape, M) and variant; caps the rounds of the slow shapes (lm_head)


def packed_call(x: torch.Tensor, pack: torch.Tensor, w: torch.Tensor, bucket: int) -> torch.Tensor:
    """x [M, K] through the pack for `bucket` rows: padded when M < bucket, chunked when M > bucket."""
    m = x.shape[0]
    if m > bucket:
        return torch.cat([packed_call(x[i:i + bucket], pack, w, bucket) for i in range(0, m, bucket)])
    if m < bucket:
        x = F.pad(x, (0, 0, 0, bucket - m))
    return torch.ops.mkl._mkl_linear(x, pack, w, None, bucket)[:m]


def probe_shape(n: int, k: int, rows: list[int], buckets: list[int], rounds: int, stream_bytes: int,
                stat: str, any_buckets: list[int]):
    """{M: {variant: median ms}} and {M: {variant: max abs diff to F.linear}}."""
    copies = max(1, -(-stream_bytes // (n * k * 4)))
    weights = [torch.randn(n, k) * 0.02 for _ in range(copies)]
    packs = {b: [torch.ops.mkl._mkl_reorder_linear_weight(w, b) for w in weights]
             for b in sorted(set(buckets) | set(any_buckets))}
    times, diffs = {}, {}
    for m in rows:
        x = torch.randn(m, k)
        variants = {"linear": lambda i: F.linear(x, weights[i])}
        for b in buckets:
            if -(-m // b) <= MAX_CHUNKS:
                variants[f"p{b}"] = lambda i, b=b: packed_call(x, packs[b][i], weights[i], b)
        for b in any_buckets:
            variants[f"a{b}"] = lambda i, b=b: torch.ops.mkl._mkl_linear(x, packs[b][i], weights[i], None, m)
        ref = F.linear(x, weights[0])
        diffs[m] = {name: (fn(0) - ref).abs().max().item() for name, fn in variants.items()}
        samples = {name: [] for name in variants}
        names, start = list(variants), time.perf_counter()
        for r in range(rounds):
            for j in range(len(names)):
                name = names[(j + r) % len(names)]
                t0 = time.perf_counter()
                variants[name]((r * len(names) + j) % copies)
                samples[name].append(time.perf_counter() - t0)
            if r >= 4 and time.perf_counter() - start > MAX_VARIANT_S * len(names):
                break
        times[m] = {name: STATS[stat](s) * 1e3 for name, s in samples.items()}
    return times, diffs


def print_table(label: str, n: int, k: int, rows: list[int], buckets: list[int], times, diffs, stat: str,
                any_buckets: list[int]) -> None:
    mb = n * k * 4 / 1e6
    print(f"\n{label}: N={n} K={k} ({mb:.1f} MB fp32); {stat} ms per call; GB/s of the best; "
          f"(xC) = C chunked calls")
    cols = ["linear"] + [f"p{b}" for b in buckets] + [f"a{b}" for b in any_buckets]
    print("    M" + "".join(f"{c:>13}" for c in cols) + "   best      GB/s  speedup  maxdiff")
    for m in rows:
        t = times[m]
        cells = []
        for c in cols:
            if c not in t:
                cells.append(f"{'-':>13}")
                continue
            chunks = -(-m // int(c[1:])) if c[0] == "p" else 1
            tag = f"(x{chunks})" if chunks > 1 else ""
            cells.append(f"{t[c]:>{13 - len(tag)}.3f}{tag}")
        best = min(t, key=t.get)
        worst_diff = max(d for name, d in diffs[m].items() if name != "linear")
        print(f"{m:>5}" + "".join(cells) + f"   {best:<8}{mb / t[best]:6.1f}  {t['linear'] / t[best]:6.2f}x"
              f"  {worst_diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="all", choices=["smol", "qwen", "all"])
    parser.add_argument("--only", default=None, help="substring of the shape labels to run")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--buckets", default="8,16,32,64")
    parser.add_argument("--any", default="", help="packs (by B) to also call with any M, e.g. 16")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--stream-mib", type=int, default=320)
    parser.add_argument("--stat", default="median", choices=list(STATS),
                        help="min: the kernel's own time when other processes stall single calls")
    ns = parser.parse_args()
    if not hasattr(torch.ops.mkl, "_mkl_linear"):
        raise SystemExit("this torch build has no MKL packed GEMM (torch.ops.mkl._mkl_linear)")
    if ns.threads:
        torch.set_num_threads(ns.threads)
    rows = [int(r) for r in ns.rows.split(",")]
    buckets = [int(b) for b in ns.buckets.split(",") if b]
    any_buckets = [int(b) for b in ns.any.split(",") if b]
    shapes = sum(SHAPES.values(), []) if ns.shapes == "all" else SHAPES[ns.shapes]
    if ns.only:
        shapes = [s for s in shapes if ns.only in s[0]]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, weights streamed from "
          f">= {ns.stream_mib} MiB, {ns.rounds} interleaved rounds")
    with torch.inference_mode():
        for label, n, k in shapes:
            times, diffs = probe_shape(n, k, rows, buckets, ns.rounds, ns.stream_mib << 20, ns.stat,
                                       any_buckets)
            print_table(label, n, k, rows, buckets, times, diffs, ns.stat, any_buckets)


if __name__ == "__main__":
    main()
