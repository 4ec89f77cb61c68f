"""`ascendserve generate PROMPT...`: run prompts through the engine and print the answers."""

import argparse
import sys

from ascendserve.cli.engine_flags import STARTUP_ERRORS, add_engine_flags, engine_args_from, positive_int


def register(sub) -> None:
    """Add the `generate` subcommand."""
    p = sub.add_parser("generate", help="generate from prompts (chat template applied unless --raw)")
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    p.add_argument("--model", default=None, help="model path or repo id (default: the embedded demo model)")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    add_engine_flags(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    """Check the sampling flags, build the engine, generate, print one answer per prompt."""
    from ascendserve.entrypoints.llm import LLM
    from ascendserve.engine.sampling_params import SamplingParams

    try:  # before the model loads, so a bad flag costs nothing
        params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p)
    except ValueError as e:
        print(f"ascendserve generate: error: {e}", file=sys.stderr)
        return 2
    try:  # a bad engine flag, model or prompt: one error line, not a traceback
        args = engine_args_from(ns)
        llm = LLM(**vars(args))
        tokenizer = llm.get_tokenizer()
        if ns.raw or tokenizer is None or not getattr(tokenizer, "chat_template", None):
            outputs = llm.generate(ns.prompts, params, use_tqdm=False)
        else:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompts], params, use_tqdm=False)
    except STARTUP_ERRORS as e:
        print(f"ascendserve generate: error: {e}", file=sys.stderr)
        return 2
    for prompt, output in zip(ns.prompts, outputs):
        print(f"Prompt: {prompt}\nAnswer: {output.outputs[0].text.strip()}\n", flush=True)
    return 0
