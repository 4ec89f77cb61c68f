"""Prometheus metrics with vLLM's names (`vllm:*`, labels `model_name` and `engine`) and the periodic stats log line.

Each server owns one `EngineMetrics` with its own CollectorRegistry, so two servers (or two engines)
in one process never share a counter; the registry also holds the process and Python collectors that
vLLM's /metrics shows from prometheus_client's global registry (process_*, python_*). The engine thread
calls `record()` after every step; the server's `/metrics` endpoint renders `registry`; `log()` prints
vLLM's throughput line.
"""

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge,
                               Histogram, disable_created_metrics)

from ascendserve.logger import init_logger

logger = init_logger(__name__)

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_N_BUCKETS = [1, 2, 5, 10, 20]


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler and caches after a step (the counters are running totals)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    # Prefix-cache lookups of first admissions: requests looked up, their tokens, the tokens found
    prefix_cache_requests: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class RequestStateStats:
    """The timings of one sequence while it runs (vLLM's RequestStateStats). Each child of an `n` request has its own:
    vLLM counts every child as a request of its own in every metric."""

    arrival_time: float
    num_generation_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class FinishedRequestStats:
    """One finished sequence. Its phases, as vLLM's: queue = arrival -> first scheduled, prefill = first scheduled ->
    first token, decode = first token -> last token, inference = first scheduled -> last token (prefill + decode, with
    any preemption inside them); a sequence with no token has prefill and decode 0 and inference up to its finish."""

    finish_reason: str
    e2e_latency: float
    queue_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    mean_time_per_output_token: float  # decode time / (tokens - 1): the first token is the prefill's
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None


@dataclass
class IterationStats:
    """What one engine step produced (the output processor fills it as it handles the step's updates)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    # Per finished user request (once for its `n` children): n, and the most tokens one of its children generated
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)
    engine_step: bool = False  # a model step ran (an idle or abort-only publish gives no iteration_tokens sample)

    def update_from_output(self, req: RequestStateStats, num_new_tokens: int, num_prompt_tokens: int,
                           now: float) -> None:
        """A sequence's new tokens: its first output gives the TTFT and counts its prompt, each later one an
        inter-token latency."""
        self.num_generation_tokens += num_new_tokens
        if req.first_token_time is None:
            self.num_prompt_tokens += num_prompt_tokens
            self.time_to_first_tokens.append(now - req.arrival_time)
            req.first_token_time = now
        else:
            self.inter_token_latencies.append(now - req.last_token_time)
        req.last_token_time = now
        req.num_generation_tokens += num_new_tokens

    def update_from_finished_request(self, req: RequestStateStats, finish_reason: str, num_prompt_tokens: int,
                                     max_tokens_param: int | None, first_scheduled_time: float | None,
                                     now: float) -> None:
        """A sequence that finished at `now` (never scheduled: its whole life was queueing)."""
        scheduled = first_scheduled_time if first_scheduled_time is not None else now
        first = req.first_token_time if req.first_token_time is not None else scheduled
        last = req.last_token_time if req.last_token_time is not None else now
        decode = last - first if req.first_token_time is not None else 0.0
        num_decoded = req.num_generation_tokens - 1
        self.finished.append(FinishedRequestStats(
            finish_reason=finish_reason, e2e_latency=now - req.arrival_time,
            queue_time=max(scheduled - req.arrival_time, 0.0), prefill_time=max(first - scheduled, 0.0),
            decode_time=decode, inference_time=max(last - scheduled, 0.0),
            mean_time_per_output_token=decode / num_decoded if num_decoded > 0 else 0.0,
            num_prompt_tokens=num_prompt_tokens, num_generation_tokens=req.num_generation_tokens,
            max_tokens_param=max_tokens_param))

    def update_from_finished_parent(self, n: int, max_num_generation_tokens: int) -> None:
        """A user request whose `n` children have all finished."""
        self.n_params.append(n)
        self.max_num_generation_tokens.append(max_num_generation_tokens)


class PrefixCachingMetrics:
    """The prefix cache hit rate over the most recent requests, as vLLM's log line shows it (its PrefixCachingMetrics).

    Lookups arrive in batches of (requests, queried tokens, hit tokens), one per step; the oldest batches drop out
    while more than `max_recent_requests` requests are held, the newest always stays. With 1000: batches of 600, 300
    and 200 requests hold 1100, so the 600 drop out and the rate is that of the last 500. A step without lookups
    changes nothing, so between bursts the rate stays that of the last requests (a per-interval rate fell to 0%).
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self._batches: deque[tuple[int, int, int]] = deque()
        self._requests = self._queries = self._hits = 0

    def observe(self, requests: int, queries: int, hits: int) -> None:
        """Add one step's lookups."""
        if requests <= 0:
            return
        self._batches.append((requests, queries, hits))
        self._requests += requests
        self._queries += queries
        self._hits += hits
        while len(self._batches) > 1 and self._requests > self.max_recent_requests:
            old_requests, old_queries, old_hits = self._batches.popleft()
            self._requests -= old_requests
            self._queries -= old_queries
            self._hits -= old_hits

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens of the requests held (0.0 before any)."""
        return self._hits / self._queries if self._queries else 0.0


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


KV_CACHE_PLACES = {"cpu": "CPU", "cuda": "GPU", "npu": "NPU"}  # torch device type -> the log line's word


def default_registry() -> CollectorRegistry:
    """A registry of its own with what prometheus_client's global one starts with: the process_* (Linux), python_info
    and python_gc_* collectors. They read the process and the interpreter, so one instance in each registry is as
    good as the global one."""
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


class EngineMetrics:
    """The `vllm:*` metrics of one served model, in a registry of its own (`engine_index` is vLLM's `engine` label:
    "0" for the one engine core a server runs)."""

    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None,
                 device_type: str = "cuda", engine_index: int = 0) -> None:
        disable_created_metrics()  # no `*_created` series, as vLLM (a process-wide switch of prometheus_client)
        self.registry = registry or default_registry()
        self.model_name = model_name
        self.engine_index = engine_index
        # The log line names where the KV cache lives, as vLLM's CPU build says "CPU KV cache usage"
        self.kv_cache_place = KV_CACHE_PLACES.get(device_type, device_type.upper())
        labels, values, r = ["model_name", "engine"], [model_name, str(engine_index)], self.registry

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(*values)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.num_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=r)
        self._success = {reason: success.labels(*values, reason) for reason in ("stop", "length", "abort")}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _ITL_BUCKETS)
        # vLLM 0.11 still serves the per-token histogram under its old name too
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            _ITL_BUCKETS)
        self.request_time_per_output_token = histogram("vllm:request_time_per_output_token_seconds",
                                                       "Histogram of time_per_output_token_seconds per request.",
                                                       _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", _LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", _LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", _LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", _LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", _ITERATION_TOKEN_BUCKETS)
        self.max_num_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                                   "Histogram of maximum number of requested generation tokens.",
                                                   token_buckets)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", token_buckets)
        self._last = SchedulerStats()  # counters already exported
        self._log_prompt_tokens = 0
        self._log_generation_tokens = 0
        self._log_time = time.monotonic()
        self._prefix_cache = PrefixCachingMetrics()  # the log line's hit rate
        self._lock = threading.Lock()  # record() runs on the engine thread, log() on the server's

    def log_engine_initialized(self, cache_config: dict[str, str]) -> None:
        """Export vllm:cache_config_info, vLLM's info metric: a gauge at 1 whose labels are the KV cache settings
        (`cache_config`, as LLMEngine.cache_config_info() gives them) and `engine`; no model_name, as vLLM's."""
        info = {**cache_config, "engine": str(self.engine_index)}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=self.registry).labels(**info).set(1)
        logger.info("Engine %03d: vllm cache_config_info with initialization after num_gpu_blocks is: %s",
                    self.engine_index, cache_config.get("num_gpu_blocks"))

    def record(self, stats: SchedulerStats, iteration: IterationStats, now: float | None = None) -> None:
        """Export one step: gauges from the snapshot, counter deltas, and the step's latencies."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self._inc(self.preemptions, stats.num_preemptions - self._last.num_preemptions)
        self._inc(self.prefix_queries, stats.prefix_cache_queries - self._last.prefix_cache_queries)
        self._inc(self.prefix_hits, stats.prefix_cache_hits - self._last.prefix_cache_hits)
        with self._lock:
            self._prefix_cache.observe(stats.prefix_cache_requests - self._last.prefix_cache_requests,
                                       stats.prefix_cache_queries - self._last.prefix_cache_queries,
                                       stats.prefix_cache_hits - self._last.prefix_cache_hits)
            self._log_prompt_tokens += iteration.num_prompt_tokens
            self._log_generation_tokens += iteration.num_generation_tokens
        self._last = stats
        self._inc(self.prompt_tokens, iteration.num_prompt_tokens)
        self._inc(self.generation_tokens, iteration.num_generation_tokens)
        if iteration.engine_step:
            self.iteration_tokens.observe(iteration.num_prompt_tokens + iteration.num_generation_tokens)
        for value in iteration.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.observe(value)
            self.time_per_output_token.observe(value)
        for n, max_num_generation_tokens in zip(iteration.n_params, iteration.max_num_generation_tokens):
            self.params_n.observe(n)
            self.max_num_generation_tokens.observe(max_num_generation_tokens)
        for finished in iteration.finished:
            self._record_finished(finished)

    def _record_finished(self, f: FinishedRequestStats) -> None:
        self._success[f.finish_reason].inc()
        self.e2e.observe(f.e2e_latency)
        self.queue_time.observe(f.queue_time)
        self.prefill_time.observe(f.prefill_time)
        self.decode_time.observe(f.decode_time)
        self.inference_time.observe(f.inference_time)
        self.request_time_per_output_token.observe(f.mean_time_per_output_token)
        self.request_prompt_tokens.observe(f.num_prompt_tokens)
        self.request_generation_tokens.observe(f.num_generation_tokens)
        if f.max_tokens_param:
            self.params_max_tokens.observe(f.max_tokens_param)

    @staticmethod
    def _inc(counter, amount: float) -> None:
        if amount > 0:
            counter.inc(amount)

    def log(self, force: bool = False) -> str | None:
        """Log vLLM's periodic line (throughput since the last call, the hit rate of the recent requests); skipped
        while fully idle."""
        now = time.monotonic()
        elapsed = max(now - self._log_time, 1e-9)
        stats = self._last
        with self._lock:
            prompt, generation = self._log_prompt_tokens, self._log_generation_tokens
            self._log_prompt_tokens = self._log_generation_tokens = 0
            hit_rate = self._prefix_cache.hit_rate
        self._log_time = now
        if not force and not (prompt or generation or stats.num_running or stats.num_waiting):
            return None
        line = (f"Engine {self.engine_index:03d}: Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generation / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"{self.kv_cache_place} KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {100 * hit_rate:.1f}%")
        logger.info(line)
        return line
