"""A/B of whole decode steps: MKL-packed linears on/off, grouped decode attention vs the GQA path before it.

One engine (fp32, packed linears) gets B requests (prompt_len random tokens, greedy, ignore_eos) and
runs until all are decoding; then the variants take turns, one `step()` each per round (order
rotating), and the median ms per step of each is printed with tokens/s. Variants, switched by
patching between steps:
  new        packed linears, grouped decode attention (this tree)
  no-pack    PackedLinear.forward replaced by plain F.linear (as ASCENDSERVE_PACKED_LINEAR=0)
  gqa-attn   the decode attention before (SDPA enable_gqa, fresh gather per layer)
  before     both: plain F.linear and the decode attention before
The context grows by four tokens per round (one per variant).

    .venv/bin/python benchmarks/probe_decode_step.py [--model PATH] [--batches 1,8,16,64]
        [--prompt-len 256] [--rounds 12] [--threads N] [--kv-gib 2] [--layers N]
With no --model: the demo model (SmolLM2-135M). --model qwen3.5-0.8b builds the random-weight
Qwen3.5-0.8B-shaped checkpoint of benchmarks/qwen3_5_speed.py (once, under the temp dir); --layers N
keeps its first N layers (hf_overrides num_hidden_layers) where memory is short.
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from ascendserve.layers import attention
from ascendserve.layers.linear import PackedLinear


def decode_before(q, kv_cache, meta, scale):
    """The decode path before the grouped-query rewrite (kept here as the A/B baseline)."""
    num_decodes, num_blocks = meta.decode_block_tables.shape
    ks = kv_cache[0][meta.decode_block_tables].view(num_decodes, -1, *kv_cache.shape[-2:])
    vs = kv_cache[1][meta.decode_block_tables].view(num_decodes, -1, *kv_cache.shape[-2:])
    q, ks, vs = q.unsqueeze(1).transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
    out = F.scaled_dot_product_attention(q, ks, vs, attn_mask=meta.decode_mask, scale=scale,
                                         enable_gqa=q.shape[1] != ks.shape[1])
    return out.transpose(1, 2)[:, 0]


def plain_forward(self, x):
    return F.linear(x, self.weight, self.bias)


def build(path, max_len, max_seqs, kv_bytes, layers):
    from ascendserve import LLM
    overrides = {"num_hidden_layers": layers} if layers else None
    return LLM(path, dtype="float32", skip_tokenizer_init=path is not None, max_model_len=max_len,
               kv_cache_memory_bytes=kv_bytes, max_num_seqs=max_seqs, max_num_batched_tokens=max(2048, max_len),
               hf_overrides=overrides)


def start(llm, batch: int, prompt_len: int, vocab: int, tag: str) -> None:
    from ascendserve import SamplingParams
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    engine = llm.llm_engine
    for i in range(batch):
        engine.add_request(f"{tag}-{batch}-{i}", {"prompt_token_ids": [rng.randrange(100, vocab - 100)
                                                                      for _ in range(prompt_len)]}, params)
    started: set[str] = set()
    while len(started) < batch:  # prefill steps, until every request has its first token
        started |= {out.request_id for out in engine.step() if out.outputs[0].token_ids}


def stop(llm, batch: int, tag: str) -> None:
    engine = llm.llm_engine
    engine.abort_request([f"{tag}-{batch}-{i}" for i in range(batch)])
    while engine.has_unfinished_requests():
        engine.step()


def run_batch(llm, batch: int, prompt_len: int, rounds: int, vocab: int) -> dict[str, float]:
    grouped, packed = attention._decode, PackedLinear.forward
    variants = {"new": (packed, grouped), "no-pack": (plain_forward, grouped),
                "gqa-attn": (packed, decode_before), "before": (plain_forward, decode_before)}
    start(llm, batch, prompt_len, vocab, "r")
    samples = {name: [] for name in variants}
    names = list(variants)
    try:
        for r in range(rounds + 1):
            for j in range(len(names)):
                name = names[(j + r) % len(names)]
                PackedLinear.forward, attention._decode = variants[name]
                t0 = time.perf_counter()
                llm.llm_engine.step()
                if r:  # round 0 warms every path up
                    samples[name].append(time.perf_counter() - t0)
    finally:
        PackedLinear.forward, attention._decode = packed, grouped
    stop(llm, batch, "r")
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8,16,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-gib", type=float, default=2)
    ap.add_argument("--layers", type=int, default=None)
    ns = ap.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    path = ns.model
    if path == "qwen3.5-0.8b":
        sys.path.insert(0, os.path.dirname(__file__))
        from qwen3_5_speed import checkpoint
        path = checkpoint(os.path.join(tempfile.gettempdir(), "ascendserve-bench"))
    batches = [int(b) for b in ns.batches.split(",")]
    max_len = ns.prompt_len + 4 * ns.rounds + 64
    llm = build(path, max_len, max(batches), int(ns.kv_gib * 2**30), ns.layers)
    vocab = llm.llm_engine.vocab_size
    layers = f" ({ns.layers} layers)" if ns.layers else ""
    print(f"model {ns.model or 'demo'}{layers}, torch {torch.__version__}, {torch.get_num_threads()} threads, prompt "
          f"{ns.prompt_len} tokens, {ns.rounds} interleaved rounds; median ms per decode step (tok/s)")
    print(f"{'B':>4}" + "".join(f"{name:>18}" for name in ("new", "no-pack", "gqa-attn", "before"))
          + f"{'new/before':>12}")
    for batch in batches:
        t = run_batch(llm, batch, ns.prompt_len, ns.rounds, vocab)
        print(f"{batch:>4}" + "".join(f"{t[n]:9.1f} ({batch * 1e3 / t[n]:5.0f})" for n in t)
              + f"{t['before'] / t['new']:11.2f}x", flush=True)


if __name__ == "__main__":
    main()
