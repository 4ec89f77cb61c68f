"""Probe decode attention over the paged KV cache: query heads as SDPA heads (GQA) vs as query rows.

One decode step of one layer: B sequences, one new token each, `ctx` cached tokens each, block
size 16, K/V gathered block by block from a cache shared by all sequences. Variants:
  gqa      q [B, Hq, 1, D], k/v [B, Hk, T, D], SDPA(enable_gqa=True), bool length mask
           (the layer before this change)
  grouped  q viewed as [B, Hk, G, D] (the G = Hq / Hk query heads of one kv head become G query
           rows), k/v [B, Hk, T, D], no enable_gqa, the same bool length mask
  ws       grouped, K and V gathered by one index_select into a buffer kept across calls (in the
           engine: allocated by the first layer of a step, reused by the others), so the gathered
           copy does not fault in fresh pages every call (the layer after this change)
  gather / gather_ws   the block gather alone, into fresh memory / into the kept buffer
  kernel / kernel_bf16 the C++ op the engine runs on CPU (ascendserve/layers/csrc/paged_decode_cpu.cpp), over
           the fp32 cache and over a bf16 copy of it (--kv-cache-dtype bfloat16), when the kernels build
  kernel_bf16q         the op with bf16 queries over the bf16 copy (a model run in bf16: vdpbf16ps where the CPU
           has AVX512-BF16, else its portable loops)
Median ms per call, variants interleaved call by call; max abs diff of ws vs gqa.

    .venv/bin/python benchmarks/probe_decode_attention.py [--batches 8,64] [--contexts 256,512,1024]
        [--rounds 30] [--threads N]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ascendserve.layers import cpu_kernels

MODELS = {"smol (9q/3kv, D=64)": (9, 3, 64), "qwen3.5 (8q/2kv, D=256)": (8, 2, 256)}
BLOCK_SIZE = 16


def gather(kv_cache, tables):
    b = tables.shape[0]
    ks = kv_cache[0][tables].view(b, -1, *kv_cache.shape[-2:])
    vs = kv_cache[1][tables].view(b, -1, *kv_cache.shape[-2:])
    return ks, vs


def gqa(q, kv_cache, tables, mask, scale):
    ks, vs = gather(kv_cache, tables)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), ks.transpose(1, 2), vs.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[:, :, 0]


def grouped(q, kv_cache, tables, mask, scale):
    ks, vs = gather(kv_cache, tables)
    b, hq, d = q.shape
    hk = ks.shape[2]
    out = F.scaled_dot_product_attention(q.view(b, hk, hq // hk, d), ks.transpose(1, 2), vs.transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    return out.reshape(b, hq, d)


def grouped_ws(q, kv_cache, tables, mask, scale, buf):
    b, hq, d = q.shape
    hk = kv_cache.shape[-2]
    kv = torch.index_select(kv_cache, 1, tables.view(-1), out=buf).view(2, b, -1, hk, d)
    out = F.scaled_dot_product_attention(q.view(b, hk, hq // hk, d), kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    return out.reshape(b, hq, d)


def probe(hq, hk, d, b, ctx, rounds):
    num_blocks = b * (-(-ctx // BLOCK_SIZE)) + 8
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, hk, d)
    tables = torch.randperm(num_blocks)[:b * (-(-ctx // BLOCK_SIZE))].view(b, -1)
    # lengths vary up to ctx, as in a real batch; the mask hides the tail of each table
    lens = torch.randint(ctx // 2, ctx + 1, (b,))
    span = torch.arange(tables.shape[1] * BLOCK_SIZE)
    mask = (span[None, :] < lens[:, None])[:, None, None, :]
    q = torch.randn(b, hq, d)
    scale = d ** -0.5
    buf = kv_cache.new_empty(2, tables.numel(), *kv_cache.shape[2:])
    variants = {"gqa": lambda: gqa(q, kv_cache, tables, mask, scale),
                "grouped": lambda: grouped(q, kv_cache, tables, mask, scale),
                "ws": lambda: grouped_ws(q, kv_cache, tables, mask, scale, buf),
                "gather": lambda: gather(kv_cache, tables),
                "gather_ws": lambda: torch.index_select(kv_cache, 1, tables.view(-1), out=buf)}
    if (kernels := cpu_kernels.ops()) is not None:
        flat_tables, kv_bf16 = tables.contiguous(), kv_cache.bfloat16()
        variants["kernel"] = lambda: kernels.paged_decode(q, kv_cache, flat_tables, lens, scale)
        variants["kernel_bf16"] = lambda: kernels.paged_decode(q, kv_bf16, flat_tables, lens, scale)
        q_bf16 = q.bfloat16()
        variants["kernel_bf16q"] = lambda: kernels.paged_decode(q_bf16, kv_bf16, flat_tables, lens, scale)
    diff = (variants["gqa"]() - variants["ws"]()).abs().max().item()
    samples = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for j in range(len(names)):
            name = names[(j + r) % len(names)]
            t0 = time.perf_counter()
            variants[name]()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}, diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--contexts", default="256,512,1024")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median ms per layer call, "
          f"{ns.rounds} interleaved rounds")
    cols = ["gqa", "grouped", "ws", "gather", "gather_ws"]
    cols += ["kernel", "kernel_bf16", "kernel_bf16q"] if cpu_kernels.ops() else []
    print(f"{'model':<26}{'B':>4}{'ctx':>6}" + "".join(f"{c:>12}" for c in cols) + f"{'ws/gqa':>9}  maxdiff")
    with torch.inference_mode():
        for label, (hq, hk, d) in MODELS.items():
            for b in (int(x) for x in ns.batches.split(",")):
                for ctx in (int(x) for x in ns.contexts.split(",")):
                    t, diff = probe(hq, hk, d, b, ctx, ns.rounds)
                    print(f"{label:<26}{b:>4}{ctx:>6}" + "".join(f"{t[c]:12.3f}" for c in cols)
                          + f"{t['gqa'] / t['ws']:8.2f}x  {diff:.1e}")


if __name__ == "__main__":
    main()
