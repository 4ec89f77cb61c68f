"""Probe torch's CPU weight-only int8/int4 kernels against dense F.linear on the engine's real shapes.

Prints ms per call for `y = x[M, K] @ W[N, K].T` with:
  fp32      F.linear, fp32 weight and activations
  bf16      F.linear, bf16 weight and activations (conversion of x not counted)
  i8        torch._weight_int8pack_mm, fp32 x, int8 weight, fp32 per-channel scales
  i8bf      same with bf16 x and scales, including the fp32 -> bf16 -> fp32 activation round trip
  i4gG      torch._weight_int4pack_mm_for_cpu, fp32 x, group size G (only where G divides K)
  i4bf64    int4 group 64 with bf16 x and scales, including the activation round trip
  deq8      dequantize int8 -> fp32 on the fly, then F.linear (the fallback without a dense copy)

Each kernel cycles through enough copies of its weight to exceed twice the last-level cache, so the
weights stream from DRAM as in a real decode step. Usage:

    .venv/bin/python benchmarks/probe_quant_kernels.py [--rows 1,2,4,8,16,32,64] [--shapes smol|lm_head|qwen|all]
        [--threads N]
"""

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name -> (N out_features, K in_features)
    "smol": [("smol gate_up", 1536 * 2, 576), ("smol down", 576, 1536), ("smol o_proj", 576, 576),
             ("smol kv", 192, 576)],
    "lm_head": [("smol lm_head", 49152, 576)],
    "qwen": [("q06 up", 3072, 1024), ("q06 down", 1024, 3072), ("q06 q_proj", 2048, 1024)],
}
STREAM_BYTES = 64 << 20  # 2x the 48 MiB L3 here
MIN_TIME_S = 0.03
SKIP_FACTOR = 8  # stop timing a kernel at larger M once it is this much slower than fp32


def _copies(t: torch.Tensor) -> int:
    return max(1, min(2000, -(-STREAM_BYTES // (t.numel() * t.element_size()))))


def _time(fn, n_weights: int) -> float:
    """Fastest single call in ms (>= 5 calls, >= MIN_TIME_S), after a short warm-up.

    The minimum, not the mean or median: this host is shared, and other processes stall single calls
    by whole scheduler periods (calls of exactly 8.0 or 16.0 ms); the minimum is the kernel's own time.
    """
    for i in range(min(n_weights, 4)):
        fn(i)
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < MIN_TIME_S or len(times) < 5:
        t0 = time.perf_counter()
        fn(len(times) % n_weights)
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def _int4_pack(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    return torch._convert_weight_to_int4pack_for_cpu(q, 2), torch.stack([scale.t(), zero.t()], -1).contiguous()


def probe_shape(n: int, k: int, rows: list[int]) -> dict[str, list[float]]:
    """ms per call of each kernel for each M in rows."""
    w = torch.randn(n, k) * 0.02
    scales = w.abs().amax(1) / 127
    w8 = (w / scales[:, None]).round().to(torch.int8)
    kernels = {
        "fp32": ([w], lambda x, p: F.linear(x, p)),
        "bf16": ([w.bfloat16()], lambda x, p: F.linear(x, p)),  # x is given in bf16 below
        "i8": ([(w8, scales)], lambda x, p: torch._weight_int8pack_mm(x, *p)),
        "i8bf": ([(w8, scales.bfloat16())], lambda x, p: torch._weight_int8pack_mm(x.bfloat16(), *p).float()),
        "deq8": ([(w8, scales)], lambda x, p: F.linear(x, p[0].float() * p[1][:, None])),
    }
    for group in (32, 64, 128):
        if k % group == 0:
            kernels[f"i4g{group}"] = ([_int4_pack(w, group)],
                                      lambda x, p, g=group: torch._weight_int4pack_mm_for_cpu(x, p[0], g, p[1]))
    if k % 64 == 0:
        packed, sz = _int4_pack(w, 64)
        kernels["i4bf64"] = ([(packed, sz.bfloat16())], lambda x, p: torch._weight_int4pack_mm_for_cpu(
            x.bfloat16(), p[0], 64, p[1]).float())
    out: dict[str, list[float]] = {}
    for name, (proto, fn) in kernels.items():
        first = proto[0][0] if isinstance(proto[0], tuple) else proto[0]
        weights = proto + [tuple(t.clone() for t in proto[0]) if isinstance(proto[0], tuple) else proto[0].clone()
                           for _ in range(_copies(first) - 1)]
        out[name] = []
        for m in rows:
            if name != "fp32" and any(not t <= SKIP_FACTOR * f for t, f in zip(out[name], out["fp32"])):
                out[name].append(float("nan"))  # already far slower than fp32 at fewer rows
                continue
            x = torch.randn(m, k, dtype=torch.bfloat16 if name == "bf16" else torch.float32)
            out[name].append(_time(lambda i: fn(x, weights[i]), len(weights)))
        del weights
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--shapes", default="all", choices=["smol", "lm_head", "qwen", "all"])
    parser.add_argument("--threads", type=int, default=None)
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    rows = [int(r) for r in ns.rows.split(",")]
    shapes = sum(SHAPES.values(), []) if ns.shapes == "all" else SHAPES[ns.shapes]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call (lower is better)")
    for label, n, k in shapes:
        res = probe_shape(n, k, rows)
        print(f"\n{label}: N={n} K={k}")
        print("   M " + "".join(f"{name:>9}" for name in res))
        for i, m in enumerate(rows):
            print(f"{m:>4} " + "".join(f"{res[name][i]:9.3f}" for name in res))


if __name__ == "__main__":
    main()
