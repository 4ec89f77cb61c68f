"""The side-by-side run's workload in-process: where a served run's seconds go, with no HTTP, client or server.

compare_cpu.py's level C is C prompts of --input-len random tokens, --output-len greedy tokens each (ignore_eos),
all sent at once. Here the same requests are added to one `LLM`'s engine together and its loop is stepped by hand
on the model thread (`run_loop_on_model_thread`, as the server's loop runs); each step counts as a prefill step
while any request still has prompt tokens to compute, as a decode step after. Printed: the whole run (s, output
tok/s: compare with the served cell of the same level), and per kind the steps' count, sum and median.

With --profile-steps K, a second replay runs under torch.profiler on the model thread: K prefill steps (from the
second on) and K decode steps, each kind's ops listed by self CPU time per step.

    LD_PRELOAD=libtcmalloc_minimal.so.4 .venv/bin/python benchmarks/replay_served_workload.py demo
    LD_PRELOAD=libtcmalloc_minimal.so.4 .venv/bin/python benchmarks/replay_served_workload.py \\
        ~/.cache/ascendserve/bench-peers/models/qwen3_5-0.8b-random [--num-prompts 64] [--input-len 256]
        [--output-len 128] [--max-num-batched-tokens 2048] [--kv-cache-gib 4] [--mamba-ssm-cache-dtype bfloat16]
        [--profile-steps 3]

(tcmalloc: the served process runs under it, ascendserve/cli/allocator.py.)
"""

import argparse
import statistics
import time

import torch

from ascendserve import LLM, SamplingParams
from ascendserve.bench.throughput import workload


def still_prefilling(engine) -> bool:
    sched = engine.scheduler
    return any(r.num_computed_tokens < r.num_prompt_tokens for r in (*sched.waiting, *sched.running))


def add_requests(engine, num_prompts: int, input_len: int, output_len: int, seed: int) -> None:
    """`num_prompts` greedy requests of `input_len` random ids (`ascendserve bench throughput`'s fixed-length
    workload) for `output_len` tokens each, ignore_eos."""
    vocab = engine.config.hf_config.get_text_config().vocab_size
    prompts, _ = workload(num_prompts, vocab, input_len, output_len, seed=seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"replay-{seed}-{i}", {"prompt_token_ids": ids}, params)


def timed_replay(engine) -> tuple[float, list[tuple[bool, float]]]:
    steps = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        prefill = still_prefilling(engine)
        t = time.perf_counter()
        engine.step()
        steps.append((prefill, time.perf_counter() - t))
    return time.perf_counter() - start, steps


def profiled_replay(engine, k: int) -> dict[str, object]:
    from torch.profiler import ProfilerActivity, profile

    tables = {}
    engine.step()  # not the first prefill step: the later ones also carry the decode rows of the prompts done
    for kind, want_prefill in (("prefill", True), ("decode", False)):
        while engine.has_unfinished_requests() and still_prefilling(engine) != want_prefill:
            engine.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(k):
                if not engine.has_unfinished_requests() or still_prefilling(engine) != want_prefill:
                    break
                engine.step()
        tables[kind] = prof
    while engine.has_unfinished_requests():
        engine.step()
    return tables


def on_model_thread(engine, fn):
    """fn() on the engine's model thread, where the server's loop runs it (the caller's thread under
    --async-scheduling, which keeps its own)."""
    future = engine.run_loop_on_model_thread(fn)
    return future.result() if future is not None else fn()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="'demo' or a checkpoint path (an HF directory or a GGUF file)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--mamba-ssm-cache-dtype", default="auto", help="a hybrid model's recurrent-state dtype")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-gib", type=float, default=4.0, help="the KV cache (and state pool) size")
    ap.add_argument("--profile-steps", type=int, default=0, help="K: also profile K prefill and K decode steps")
    ns = ap.parse_args()
    if min(ns.num_prompts, ns.input_len, ns.output_len) < 1 or ns.kv_cache_gib <= 0 or ns.profile_steps < 0:
        ap.error("--num-prompts, --input-len and --output-len must be >= 1, --kv-cache-gib above 0, "
                 "--profile-steps >= 0")
    demo = ns.model == "demo"
    llm = LLM(None if demo else ns.model, skip_tokenizer_init=True, dtype=ns.dtype,
              max_model_len=ns.input_len + ns.output_len + 64, kv_cache_memory_bytes=int(ns.kv_cache_gib * (1 << 30)),
              max_num_seqs=ns.num_prompts, max_num_batched_tokens=ns.max_num_batched_tokens,
              mamba_ssm_cache_dtype=ns.mamba_ssm_cache_dtype)
    engine = llm.llm_engine
    # warm-up: a prefill and a few decode steps (the kernels' first calls, the allocator's first spans)
    add_requests(engine, min(8, ns.num_prompts), 64, 4, seed=ns.seed + 1_000_000)
    while engine.has_unfinished_requests():
        engine.step()

    add_requests(engine, ns.num_prompts, ns.input_len, ns.output_len, seed=ns.seed)
    total, steps = on_model_thread(engine, lambda: timed_replay(engine))
    tokens = ns.num_prompts * ns.output_len
    print(f"{ns.model}: {ns.num_prompts} x {ns.input_len} in / {ns.output_len} out, "
          f"max_num_batched_tokens {ns.max_num_batched_tokens}, {torch.get_num_threads()} threads")
    print(f"whole run {total:.2f} s, {tokens / total:.1f} output tok/s, {len(steps)} steps")
    for kind, want in (("prefill", True), ("decode", False)):
        times = [t for p, t in steps if p == want]
        if times:
            print(f"  {kind:7s} steps {len(times):4d}  sum {sum(times):7.2f} s  "
                  f"median {1e3 * statistics.median(times):8.1f} ms")

    if ns.profile_steps > 0:
        add_requests(engine, ns.num_prompts, ns.input_len, ns.output_len, seed=ns.seed + 1)
        profs = on_model_thread(engine, lambda: profiled_replay(engine, ns.profile_steps))
        for kind, prof in profs.items():
            print(f"\n{kind} steps (up to {ns.profile_steps}), ops by self CPU time:")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))


if __name__ == "__main__":
    main()
