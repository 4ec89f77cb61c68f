"""Time the CPU kernels of a bf16 step that session 30 changed, with this checkout's build, over realistic sizes:

  decode    paged_decode over LAYERS layers' own caches (64 requests x 330 tokens on random blocks, from DRAM)
  prefill   prefill_attention over LAYERS layers (8 causal prompts of 256 tokens)
  argmax    the lm_head at 1 and 64 rows: logits (bf16_linear_bf16x, fp32 out) + argmax_rows, against the fused
            bf16_linear_argmax where it runs (AMX, or vdpbf16ps)
for the demo's shapes (30 layers, 9 / 3 heads of 64, 49152 x 576 lm_head) and Qwen3.5-0.8B's (6 attention layers,
8 / 2 heads of 256, 248320 x 1024). Median ms of --rounds. A before / after needs two checkouts (or builds) run in turn.

    .venv/bin/python benchmarks/probe_step_ops.py [--rounds 9]
"""

import argparse
import statistics
import time

import torch

from ascendserve.layers import cpu_kernels
from ascendserve.layers.compact_linear import pack_bf16
from ascendserve.worker.sampler import argmax_rows

SHAPES = {"demo": (30, 9, 3, 64, 49152, 576), "qwen3.5": (6, 8, 2, 256, 248320, 1024)}
BLOCK = 16


def median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:] if rounds > 2 else times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    ops = cpu_kernels.ops()
    if ops is None:
        raise SystemExit("the CPU kernels did not build")
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, median of {args.rounds} rounds, ms; prefill on "
          f"{'AMX' if ops.prefill_attention_amx() else 'vdpbf16ps' if ops.prefill_attention_dot() else 'fp32 loops'}")
    for name, (layers, hq, hk, d, vocab, hidden) in SHAPES.items():
        batch, ctx = 64, 330
        blocks = -(-ctx // BLOCK)
        num_blocks = batch * blocks + 64
        caches = [torch.randn(2, num_blocks, BLOCK, hk, d).bfloat16() for _ in range(layers)]
        tables = torch.stack([torch.randperm(num_blocks)[:blocks] for _ in range(batch)])
        lens = torch.full((batch,), ctx, dtype=torch.long)
        q = torch.randn(batch, hq, d).bfloat16()
        decode = median_ms(lambda: [ops.paged_decode(q, c, tables, lens, d ** -0.5) for c in caches], args.rounds)

        count, tokens = 8, 256
        qkv = torch.randn(count * tokens, hq + 2 * hk, d).bfloat16()
        pq, pk, pv = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
        out = torch.empty(pq.shape, dtype=pq.dtype)
        prefill = median_ms(lambda: [ops.prefill_attention(out, pq, pk, pv, count, d ** -0.5) for _ in range(layers)],
                            args.rounds)
        del caches
        print(f"{name}: decode attention {layers} layers x {batch} x {ctx} tokens {decode:.1f}; "
              f"prefill attention {layers} layers x {count} x {tokens} {prefill:.1f}")

        packed = pack_bf16(torch.randn(vocab, hidden).bfloat16() * 0.05)
        fused_runs = bool(ops.bf16_amx() or ops.bf16_dot())
        for rows in (1, 64):
            x = torch.randn(rows, hidden).bfloat16()
            logits = median_ms(lambda: argmax_rows(ops.bf16_linear_bf16x(x, packed, vocab, None, False)), args.rounds)
            fused = median_ms(lambda: ops.bf16_linear_argmax(x, packed, vocab), args.rounds) if fused_runs else None
            print(f"{name}: lm_head {vocab} x {hidden}, {rows} rows: logits + argmax_rows {logits:.2f}, fused "
                  + (f"{fused:.2f}" if fused is not None else "not here"))


if __name__ == "__main__":
    main()
