"""A/B of whole decode steps: the fp32 linears on each GEMM (the C++ panel kernel, oneDNN's, MKL's).

One engine (fp32; its fp32 linears made PanelLinear, ASCENDSERVE_FP32_GEMM=panel) gets B requests (prompt_len
random tokens, greedy, ignore_eos) and runs until all are decoding; then the variants take turns, one `step()`
each per round (order rotating), and the median ms per step of each is printed with tokens/s. Variants,
switched by patching PanelLinear.forward between steps:
  panel      the C++ kernel on the layer's panels (csrc/f32_linear_cpu.cpp)
  onednn     oneDNN's GEMM on the layer's fp32 weight (DenseLinear's product)
  mkl        F.linear on it (MKL's sgemm)
Layers that are not PanelLinear (the demo's 4-bit / 8-bit copies up to 32 / 24 rows, bf16 weights) run as
they would. The context grows by three tokens per round (one per variant).

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

from ascendserve.layers import linear
from ascendserve.layers.linear import PanelLinear


def onednn_forward(self, x):
    return linear._onednn_linear(x.reshape(-1, self.in_features).contiguous(), self.weight,
                                 self.bias).reshape(*x.shape[:-1], self.out_features)


def mkl_forward(self, x):
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
    variants = {"panel": PanelLinear.forward, "onednn": onednn_forward, "mkl": mkl_forward}
    start(llm, batch, prompt_len, vocab, "r")
    samples = {name: [] for name in variants}
    names = list(variants)
    try:
        for r in range(rounds + 1):
            for j in range(len(names)):
                name = names[(j + r) % len(names)]
                PanelLinear.forward = variants[name]
                t0 = time.perf_counter()
                llm.llm_engine.step()
                if r:  # round 0 warms every path up
                    samples[name].append(time.perf_counter() - t0)
    finally:
        PanelLinear.forward = variants["panel"]
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
    os.environ[linear.FP32_GEMM_ENV_VAR] = "panel"
    max_len = ns.prompt_len + 3 * ns.rounds + 64
    llm = build(path, max_len, max(batches), int(ns.kv_gib * 2**30), ns.layers)
    vocab = llm.llm_engine.vocab_size
    layers = f" ({ns.layers} layers)" if ns.layers else ""
    print(f"model {ns.model or 'demo'}{layers}, torch {torch.__version__}, {torch.get_num_threads()} threads, prompt "
          f"{ns.prompt_len} tokens, {ns.rounds} interleaved rounds; median ms per decode step (tok/s)")
    panels = sum(isinstance(m, PanelLinear) for m in llm.llm_engine.runner.model.modules())
    print(f"{panels} PanelLinear layers")
    print(f"{'B':>4}" + "".join(f"{name:>18}" for name in ("panel", "onednn", "mkl")) + f"{'onednn/panel':>14}")
    for batch in batches:
        t = run_batch(llm, batch, ns.prompt_len, ns.rounds, vocab)
        print(f"{batch:>4}" + "".join(f"{t[n]:9.1f} ({batch * 1e3 / t[n]:5.0f})" for n in t)
              + f"{t['onednn'] / t['panel']:13.2f}x", flush=True)


if __name__ == "__main__":
    main()
