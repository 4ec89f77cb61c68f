"""AsyncLLM: per-request queues over one engine thread; cancellation aborts; loop errors reach every caller."""

import asyncio
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from ascendserve.config import EngineArgs
from ascendserve.engine.async_engine import AsyncLLM, EngineDeadError
from ascendserve.engine.outputs import CompletionOutput, RequestOutput
from ascendserve.engine.sampling_params import RequestOutputKind, SamplingParams
from ascendserve.metrics import EngineMetrics


@pytest.fixture(scope="module")
def llm():
    """The demo model behind an AsyncLLM (one per module: loading takes ~25 s)."""
    metrics = EngineMetrics("demo", 1024)
    llm = AsyncLLM.from_engine_args(EngineArgs(max_model_len=1024, kv_cache_memory_bytes=64 * 2**20,
                                               max_num_seqs=8), metrics)
    yield llm
    llm.shutdown()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, output_kind=RequestOutputKind.DELTA, **kw)


async def wait_idle(llm: AsyncLLM, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = llm.scheduler_stats
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0:
            return
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.05)


async def collect(llm: AsyncLLM, prompt, params, request_id: str) -> tuple[str, list[int], list[RequestOutput]]:
    outputs = [o async for o in llm.generate(prompt, params, request_id)]
    return "".join(o.outputs[0].text for o in outputs), [t for o in outputs for t in o.outputs[0].token_ids], outputs


def test_concurrent_generators_each_get_their_own_outputs(llm):
    prompts = ["The sky is", "One, two, three,", "My favourite food is", "def add(a, b):"]

    async def run():
        together = await asyncio.gather(*[collect(llm, p, greedy(6), f"c{i}") for i, p in enumerate(prompts)])
        alone = [await collect(llm, p, greedy(6), f"s{i}") for i, p in enumerate(prompts)]
        return together, alone
    together, alone = asyncio.run(run())
    for i, ((text, ids, outputs), (text1, ids1, _)) in enumerate(zip(together, alone)):
        assert all(o.request_id == f"c{i}" for o in outputs)
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        assert len(ids) == 6 and (text, ids) == (text1, ids1)


def test_cancelled_iterator_aborts_and_frees_blocks(llm):
    async def run():
        outputs = []

        async def consume():
            async for output in llm.generate("Once upon a time", greedy(900, ignore_eos=True), "long"):
                outputs.append(output)
        task = asyncio.create_task(consume())
        while len(outputs) < 2:
            await asyncio.sleep(0.01)
        assert llm.scheduler_stats.kv_cache_usage > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(llm)
        # breaking out of the loop aborts too
        async for _ in llm.generate("Once upon a time", greedy(900, ignore_eos=True), "long2"):
            break
        await wait_idle(llm)
    asyncio.run(run())
    assert not llm.engine.scheduler.requests and not llm.engine.output_processor.parents


def test_explicit_abort_ends_the_stream_with_finish_reason_abort(llm):
    async def run():
        stream = await llm.add_request("abort-me", "Hello", greedy(900, ignore_eos=True))
        first = await anext(stream)
        llm.abort("abort-me")
        rest = [o async for o in stream]
        return first, rest
    first, rest = asyncio.run(run())
    assert not first.finished and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"


def test_bad_request_raises_at_add(llm):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await llm.add_request("too-long", {"prompt_token_ids": [1] * 2000}, greedy(4))
        with pytest.raises(ValueError, match="empty"):
            await llm.add_request("empty", {"prompt_token_ids": []}, greedy(4))
        await wait_idle(llm)
    asyncio.run(run())


def test_metrics_move_and_registries_are_separate(llm):
    generated = llm.metrics.generation_tokens._value.get()
    asyncio.run(collect(llm, "Hi", greedy(3, ignore_eos=True), "m1"))
    assert llm.metrics.generation_tokens._value.get() == generated + 3
    other = EngineMetrics("demo", 1024)  # same names, another registry: no clash, no sharing
    assert other.generation_tokens._value.get() == 0


# -- engine failures, with a scripted engine ---------------------------------------------------------

class FailingEngine:
    """LLMEngine's surface; step() produces one token per request, then raises on the `fail_at`-th call."""

    def __init__(self, fail_at: int) -> None:
        self.tokenizer = None
        self.config = SimpleNamespace(max_model_len=100, args=EngineArgs())
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions=0)
        self.kv_cache_manager = SimpleNamespace(usage=lambda: 0.0, num_queried_requests=0, num_queries=0, num_hits=0)
        self.requests: list[str] = []
        self.fail_at, self.steps = fail_at, 0
        self.seen_by_step: list[int] = []  # requests present at each step
        self.thread_ids: set[int] = set()

    def add_request(self, request_id, prompt, params, arrival_time=None):
        self.thread_ids.add(threading.get_ident())
        self.requests.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self, iteration_stats=None):
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        self.seen_by_step.append(len(self.requests))
        if self.steps >= self.fail_at:
            raise RuntimeError("device lost")
        time.sleep(0.01)
        return [RequestOutput(r, None, [1], [CompletionOutput(0, "x", [7], None, None)], False)
                for r in self.requests]

    def abort_request(self, request_ids, iteration_stats=None):
        self.requests = [r for r in self.requests if r not in request_ids]
        return []


def test_engine_error_reaches_every_caller_and_later_ones():
    engine = FailingEngine(fail_at=3)
    llm = AsyncLLM(engine)

    async def run():
        async def consume(i):
            return [o async for o in llm.generate("x", greedy(10), f"r{i}")]
        results = await asyncio.wait_for(asyncio.gather(*[consume(i) for i in range(3)], return_exceptions=True),
                                         timeout=10)
        with pytest.raises(EngineDeadError):
            await llm.add_request("late", "x", greedy(1))
        return results
    results = asyncio.run(run())
    assert all(isinstance(r, EngineDeadError) and "device lost" in str(r) for r in results), results
    assert llm.errored and isinstance(llm.dead_error, RuntimeError)
    assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids  # engine thread only
    llm.shutdown()


def test_caller_cancelled_before_the_add_is_applied_leaves_nothing_behind():
    engine = FailingEngine(fail_at=10**9)
    engine.requests.append("busy")  # keeps the loop stepping, so adds wait in the inbox
    llm = AsyncLLM(engine)

    async def run():
        task = asyncio.create_task(llm.add_request("cancelled", "x", greedy(1)))
        await asyncio.sleep(0)  # the add is queued
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stream = await asyncio.wait_for(llm.add_request("after", "x", greedy(1)), timeout=5)  # loop still alive
        return await asyncio.wait_for(anext(stream), timeout=5)
    output = asyncio.run(run())
    assert output.request_id == "after" and "cancelled" not in engine.requests and not llm.errored
    llm.shutdown()


# -- requests sent together, from idle ----------------------------------------------------------------

def _first_step_after_burst(window_ms: float, count: int, gap_s: float) -> int:
    """How many of `count` adds (gap_s apart, sent to an idle engine) the first step saw."""
    engine = FailingEngine(fail_at=10**9)
    llm = AsyncLLM(engine, arrival_window_ms=window_ms)

    async def run():
        adds = []
        for i in range(count):
            adds.append(asyncio.create_task(llm.add_request(f"r{i}", "x", greedy(1))))
            await asyncio.sleep(gap_s)
        await asyncio.wait_for(asyncio.gather(*adds), timeout=30)
        while not engine.seen_by_step:
            await asyncio.sleep(0.01)
    asyncio.run(run())
    llm.shutdown()
    return engine.seen_by_step[0]


def test_a_burst_of_requests_goes_into_the_first_step_together():
    # 2 ms apart, a 100 ms window: every gap is far inside it, so the first step sees all four.
    assert _first_step_after_burst(100, count=4, gap_s=0.002) == 4


def test_the_wait_for_arrivals_is_capped():
    # Arrivals every 5 ms for ~0.5 s never leave a 20 ms gap; the first step must not wait past 10 windows (0.2 s).
    assert 1 <= _first_step_after_burst(20, count=100, gap_s=0.005) < 100


def test_arrival_window_zero_steps_at_once(monkeypatch):
    engine = FailingEngine(fail_at=10**9)
    llm = AsyncLLM(engine, arrival_window_ms=0)
    sleeps = []
    monkeypatch.setattr("ascendserve.engine.async_engine.time.sleep", lambda s: sleeps.append(s))
    llm._await_arrivals()
    assert sleeps == []
    llm.shutdown()


@pytest.mark.parametrize("value", [-1, 1001])
def test_arrival_window_out_of_range_is_refused(value):
    with pytest.raises(ValueError, match=r"arrival_window_ms must be in \[0, 1000\]"):
        EngineArgs(arrival_window_ms=value).validate()


# -- which thread runs the loop -----------------------------------------------------------------------

def test_the_loop_steps_on_the_model_thread_with_no_hand_off(llm, monkeypatch):
    # Without --async-scheduling the loop runs on the engine's model thread: step() calls the model there directly.
    engine, threads, handed_over = llm.engine, [], []
    execute, submit = engine.runner.execute_model, engine._model_thread.submit

    def spy(sched):
        threads.append(threading.current_thread().name)
        return execute(sched)
    monkeypatch.setattr(engine.runner, "execute_model", spy)
    monkeypatch.setattr(engine._model_thread, "submit", lambda *a: handed_over.append(a) or submit(*a))
    _, ids, _ = asyncio.run(collect(llm, "The sky is", greedy(4, ignore_eos=True), "on-the-model-thread"))
    assert len(ids) == 4 and handed_over == [] and llm._thread is None
    assert {name.rsplit("_", 1)[0] for name in threads} == {"ascendserve-model"}


def test_with_async_scheduling_the_loop_keeps_its_own_thread(llm):
    # Its steps overlap on the model thread, so the loop cannot run there; same tokens as the synchronous loop.
    overlapped = AsyncLLM.from_engine_args(EngineArgs(max_model_len=1024, kv_cache_memory_bytes=64 * 2**20,
                                                      max_num_seqs=8, async_scheduling=True))
    try:
        assert overlapped._thread.name == "ascendserve-engine" and overlapped._loop is None
        expected = asyncio.run(collect(llm, "One, two, three,", greedy(8, ignore_eos=True), "sync"))[:2]
        got = asyncio.run(collect(overlapped, "One, two, three,", greedy(8, ignore_eos=True), "overlapped"))[:2]
        assert got == expected and len(got[1]) == 8
    finally:
        overlapped.shutdown()
    assert not overlapped._thread.is_alive()


def test_the_interpreter_exits_while_the_loop_runs_on_the_model_thread():
    # The model thread is no daemon and the interpreter's exit joins it: the loop must stop by then, also when
    # shutdown() was never called and a request is still running.
    script = """if True:
        import asyncio
        from ascendserve.config import EngineArgs
        from ascendserve.engine.async_engine import AsyncLLM
        from ascendserve.engine.sampling_params import SamplingParams
        llm = AsyncLLM.from_engine_args(EngineArgs(max_model_len=1024, kv_cache_memory_bytes=64 * 2**20))
        assert llm._loop is not None
        params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
        asyncio.run(llm.add_request("left-running", "Once upon a time", params))
        print("exiting", flush=True)
    """
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        log = []
        for line in proc.stdout:  # loading the demo model takes ~30 s on 2 busy cores
            log.append(line)
            if line.startswith("exiting"):
                break
        assert proc.wait(timeout=30) == 0, "".join(log[-20:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_num_waiting_counts_only_what_the_free_slots_cannot_take(llm):
    """max_num_seqs 8: eight requests added at once wait for nothing (the next step runs them all); a ninth and
    tenth wait. --max-waiting-requests compares this number, so a burst that fits is never refused."""
    async def run():
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        streams = list(await asyncio.gather(*[llm.add_request(f"w{i}", "Once upon a time", params)
                                              for i in range(8)]))
        fitting = [llm.num_waiting]  # at once: queued in the scheduler, not yet stepped
        await asyncio.sleep(0.5)
        fitting.append(llm.num_waiting)  # running
        streams += await asyncio.gather(*[llm.add_request(f"w{i}", "Once upon a time", params) for i in (8, 9)])
        await asyncio.sleep(0.5)
        over = llm.num_waiting
        for stream in streams:
            stream.abort()
        await wait_idle(llm)
        return fitting, over
    assert asyncio.run(run()) == ([0, 0], 2)


def test_num_waiting_counts_every_sequence_the_kv_cache_holds_back():
    """Free seq slots but a full KV cache (32 blocks; each ~150-token prompt takes 10): the requests the step could
    not schedule all count as waiting, so --max-waiting-requests still trips in that overload."""
    small = AsyncLLM.from_engine_args(EngineArgs(max_model_len=256, num_gpu_blocks_override=32, block_size=16,
                                                 max_num_seqs=8))

    async def run():
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        prompts = [f"{i} " + " ".join(["word"] * 150) for i in range(6)]  # no shared prefix blocks
        streams = list(await asyncio.gather(*[small.add_request(f"k{i}", p, params) for i, p in enumerate(prompts)]))
        await asyncio.sleep(1.0)
        stats, waiting = small.scheduler_stats, small.num_waiting
        for stream in streams:
            stream.abort()
        await wait_idle(small)
        return stats, waiting
    try:
        stats, waiting = asyncio.run(run())
    finally:
        small.shutdown()
    assert stats.num_running < 6 and waiting == 6 - stats.num_running


def sample(llm: AsyncLLM, name: str, **labels) -> float:
    """One sample of the engine's metrics registry (0.0 while absent)."""
    return llm.metrics.registry.get_sample_value(name, {"model_name": "demo", "engine": "0", **labels}) or 0.0


def test_metrics_count_each_child_of_n_under_its_own_finish_reason(llm):
    """n=4 children that finish at different steps: each is counted as stop or length in request_success_total; the
    last output (DELTA) holds only the children that finished in its step, and the others were counted as aborts."""
    def count(reason: str) -> float:
        return sample(llm, "vllm:request_success_total", finished_reason=reason)

    async def run():
        params = SamplingParams(n=4, seed=3, temperature=1.0, max_tokens=40, stop=["\n"],
                                output_kind=RequestOutputKind.DELTA)
        outputs = [o async for o in llm.generate("Say hi", params, "n4")]
        await wait_idle(llm)
        return outputs
    before = {reason: count(reason) for reason in ("stop", "length", "abort")}
    outputs = asyncio.run(run())
    reasons = [c.finish_reason for o in outputs for c in o.outputs if c.finish_reason]
    assert sorted(reasons) != sorted(c.finish_reason for c in outputs[-1].outputs if c.finish_reason), \
        "the children should finish in different steps for this test to mean anything"
    after = {reason: count(reason) for reason in ("stop", "length", "abort")}
    assert {r: after[r] - before[r] for r in after} == {r: float(reasons.count(r)) for r in ("stop", "length", "abort")}


def _final_output_when_idle(llm, params, request_id: str):
    """Generate from "Once upon a time"; the last output, once the engine is idle again (its metrics published)."""
    async def run():
        outputs = [o async for o in llm.generate("Once upon a time", params, request_id)]
        await wait_idle(llm)
        return outputs[-1]
    return asyncio.run(run())


def test_metrics_count_each_child_of_n_as_a_request(llm):
    """vLLM V1 counts every child of an `n` request as a request of its own: its prompt in prompt_tokens, one TTFT,
    one inter-token latency per later token, one e2e latency each (was: the prompt and the TTFT once per parent, one
    inter-token latency per parent step)."""
    names = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_prompt_tokens_count",
             "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
             "vllm:e2e_request_latency_seconds_count"]
    before = {name: sample(llm, name) for name in names}
    final = _final_output_when_idle(llm, SamplingParams(n=3, seed=1, temperature=1.0, max_tokens=5, ignore_eos=True,
                                                        output_kind=RequestOutputKind.FINAL_ONLY), "n3")
    assert [len(c.token_ids) for c in final.outputs] == [5, 5, 5]
    prompt_len = len(final.prompt_token_ids)
    assert {name: sample(llm, name) - before[name] for name in names} == {
        "vllm:prompt_tokens_total": 3 * prompt_len, "vllm:generation_tokens_total": 15,
        "vllm:request_prompt_tokens_count": 3, "vllm:time_to_first_token_seconds_count": 3,
        "vllm:inter_token_latency_seconds_count": 12, "vllm:e2e_request_latency_seconds_count": 3}


def test_metrics_request_phases_params_and_step_tokens(llm):
    """vLLM's request histograms: each child's phases (prefill, decode, inference, its mean time per output token) and
    its max_tokens; n and the longest child once per user request; one iteration_tokens_total sample per engine step,
    its prompt and generated tokens."""
    names = ["vllm:request_params_n_count", "vllm:request_params_n_sum", "vllm:request_max_num_generation_tokens_sum",
             "vllm:request_params_max_tokens_count", "vllm:request_params_max_tokens_sum",
             "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
             "vllm:request_decode_time_seconds_sum", "vllm:request_inference_time_seconds_count",
             "vllm:request_time_per_output_token_seconds_count", "vllm:request_time_per_output_token_seconds_sum",
             "vllm:time_per_output_token_seconds_count", "vllm:iteration_tokens_total_count",
             "vllm:iteration_tokens_total_sum"]
    before = {name: sample(llm, name) for name in names}
    final = _final_output_when_idle(llm, SamplingParams(n=2, seed=1, temperature=1.0, max_tokens=6, ignore_eos=True,
                                                        output_kind=RequestOutputKind.FINAL_ONLY), "phases")
    delta = {name: sample(llm, name) - before[name] for name in names}
    assert (delta["vllm:request_params_n_count"], delta["vllm:request_params_n_sum"]) == (1, 2)
    assert delta["vllm:request_max_num_generation_tokens_sum"] == 6
    assert (delta["vllm:request_params_max_tokens_count"], delta["vllm:request_params_max_tokens_sum"]) == (2, 12)
    for phase in ("prefill", "decode", "inference"):
        assert delta[f"vllm:request_{phase}_time_seconds_count"] == 2, phase
    assert delta["vllm:request_time_per_output_token_seconds_count"] == 2
    assert delta["vllm:request_time_per_output_token_seconds_sum"] == pytest.approx(
        delta["vllm:request_decode_time_seconds_sum"] / 5)
    assert delta["vllm:time_per_output_token_seconds_count"] == 10  # per token after each child's first
    assert delta["vllm:iteration_tokens_total_count"] >= 6  # the prefill step, then 5 decode steps
    assert delta["vllm:iteration_tokens_total_sum"] == 2 * len(final.prompt_token_ids) + 12


def test_metrics_cache_config_info(llm):
    """vllm:cache_config_info carries the engine's KV cache settings as labels (vLLM's CacheConfig fields)."""
    info = llm.engine.cache_config_info()
    assert info["num_gpu_blocks"] == str(llm.engine.kv_cache_manager.num_blocks) != "0"
    assert (info["block_size"], info["cache_dtype"], info["enable_prefix_caching"]) == ("16", "auto", "True")
    assert info["kv_cache_memory_bytes"] == str(64 * 2**20) and info["gpu_memory_utilization"] == "0.9"
    assert llm.metrics.registry.get_sample_value("vllm:cache_config_info", {**info, "engine": "0"}) == 1.0
