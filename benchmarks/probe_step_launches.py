"""Count what a prefill step and a decode step launch on the GPU path, without a GPU: the torch ops they dispatch
(views apart) and the Triton kernels they call, with and without ASCENDSERVE_TRITON_KERNELS, on Qwen3.5-0.8B's layer
layout (18 Gated DeltaNet + 6 attention layers, its head counts) at narrower widths and a small vocabulary, in fp32 on
the CPU with the CPU kernels off (the plain-torch forms a GPU runs) and eager (no torch.compile: on a GPU the norms,
activation and rotary compile into fewer kernels; a count of the compiled forward needs the GPU). The Triton kernels
run under the interpreter (TRITON_INTERPRET=1, set here before triton loads).

    .venv/bin/python benchmarks/probe_step_launches.py [--batch 4]
"""

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["ASCENDSERVE_CPU_KERNELS"] = "0"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen3_5_speed import QWEN3_5_08B  # noqa: E402
from tests.models.qwen3_5_tiny import TRITON_KERNELS  # noqa: E402

NARROW = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, linear_key_head_dim=32,
              linear_value_head_dim=32, head_dim=64)


class CountOps(TorchDispatchMode):
    """Counts dispatched aten ops by name, views (no kernel) apart, and the Triton kernels called (what the interpreter
    dispatches to run one is not counted: on a GPU it is one launch)."""

    def __init__(self):
        super().__init__()
        self.ops, self.views, self.kernels, self.in_kernel = Counter(), 0, Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.in_kernel:
            pass
        elif torch.Tag.view_copy in func.tags or func.is_view:
            self.views += 1
        else:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def kernel(self, name: str, fn, *args, **kwargs):
        self.kernels[name] += 1
        self.in_kernel = True
        try:
            return fn(*args, **kwargs)
        finally:
            self.in_kernel = False


def count_steps(path: str, batch: int, triton: bool) -> dict[str, CountOps]:
    """The counts of the first step of `batch` requests (their whole 30-token prompts at once) and of their first
    pure decode step."""
    from ascendserve import LLM, SamplingParams
    from ascendserve.layers import triton_ops
    os.environ["ASCENDSERVE_TRITON_KERNELS"] = "1" if triton else "0"
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", device="cpu", enforce_eager=True,
              num_gpu_blocks_override=64, max_model_len=256)
    runner, modes, originals, counting = llm.llm_engine.runner, {}, {}, []
    for name in TRITON_KERNELS:
        originals[name] = fn = getattr(triton_ops, name)
        setattr(triton_ops, name, lambda *a, _fn=fn, _n=name, **k: counting[0].kernel(_n, _fn, *a, **k) if counting
                else _fn(*a, **k))
    execute = runner.execute_model

    def execute_counted(sched):
        kind = "decode" if all(s.num_tokens == 1 and s.start_pos > 0 for s in sched.scheduled) else "prefill"
        if kind in modes:
            return execute(sched)
        counting.append(modes.setdefault(kind, CountOps()))
        try:
            with counting[0]:
                return execute(sched)
        finally:
            counting.clear()

    runner.execute_model = execute_counted
    prompts = [{"prompt_token_ids": list(range(10 + i, 40 + i))} for i in range(batch)]
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        for name, fn in originals.items():
            setattr(triton_ops, name, fn)
    return modes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    with tempfile.TemporaryDirectory() as work:
        config = Qwen3_5TextConfig(**{**QWEN3_5_08B, **NARROW}, architectures=["Qwen3_5ForCausalLM"])
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(work)
        rows = {triton: count_steps(work, args.batch, triton) for triton in (False, True)}
    print(f"{args.batch} requests, Qwen3.5-0.8B's layers (narrowed), eager, plain torch around:")
    print("| step | Triton kernels | torch ops (no views) | views | Triton launches | top torch ops |")
    print("|---|---|---|---|---|---|")
    for kind in ("prefill", "decode"):
        for triton, modes in rows.items():
            mode = modes[kind]
            top = ", ".join(f"{n} {c}" for n, c in mode.ops.most_common(6))
            print(f"| {kind} | {'on' if triton else 'off'} | {sum(mode.ops.values())} | {mode.views} | "
                  f"{sum(mode.kernels.values())} | {top} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
