"""Time the sampler on one step's logits: ms per call for greedy and the usual random configurations.

Logits are a peaked random row per request ([rows, vocab] fp32, N(0, 1) x 3: a nucleus of 0.95 within a few hundred
tokens, as a trained model's usually is), the rows unseeded, one Sampler for every call. A before / after runs two
checkouts in turn (the other one first on PYTHONPATH).

    .venv/bin/python benchmarks/probe_sampler.py [--rows 1,8,64] [--vocab 49152,248320] [--rounds 9]
"""

import argparse
import statistics
import time

import torch

from ascendserve.engine.sampling_params import SamplingParams
from ascendserve.worker.sampler import Sampler, SamplingRow

CONFIGS = {
    "greedy": {"temperature": 0.0},
    "T=1": {"temperature": 1.0},
    "T=0.7 top_p=0.95 top_k=20": {"temperature": 0.7, "top_p": 0.95, "top_k": 20},
    "T=0.6 top_p=0.95": {"temperature": 0.6, "top_p": 0.95},
    "T=1 top_k=50": {"temperature": 1.0, "top_k": 50},
}


def median_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--vocab", default="49152,248320")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"threads {torch.get_num_threads()}, median ms per call of {args.rounds}")
    print("| vocab | configuration | " + " | ".join(f"{r} rows" for r in rows_list) + " |")
    print("|---|---|" + "---|" * len(rows_list))
    for vocab in (int(v) for v in args.vocab.split(",")):
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(max(rows_list), vocab, generator=gen) * 3
        for name, kwargs in CONFIGS.items():
            cells = []
            for rows in rows_list:
                batch = [SamplingRow(SamplingParams(**kwargs), [], []) for _ in range(rows)]
                sampler = Sampler(seed=0)
                cells.append(f"{median_ms(lambda: sampler(logits[:rows], batch), args.rounds):.2f}")
            print(f"| {vocab} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
