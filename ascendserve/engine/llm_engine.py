"""The synchronous engine: add requests, step, collect RequestOutputs."""

import itertools
import numbers
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from ascendserve.config import EngineArgs, EngineConfig
from ascendserve.engine.kv_cache_manager import KVCacheManager
from ascendserve.engine.outputs import RequestOutput
from ascendserve.engine.output_processor import OutputProcessor
from ascendserve.engine.request import Request, RequestStatus
from ascendserve.engine.sampling_params import SamplingParams
from ascendserve.engine.scheduler import Scheduler, SchedulerOutput
from ascendserve.engine.state_cache_manager import StateCacheManager
from ascendserve.engine.structured_output import GrammarCompiler
from ascendserve.logger import init_logger
from ascendserve.metrics import IterationStats

logger = init_logger(__name__)


class PromptTooLongError(ValueError):
    """A prompt does not fit in max_model_len (or in the KV cache)."""


class LLMEngine:
    """Scheduler + model runner + output processor, driven one `step()` at a time."""

    def __init__(self, config: EngineConfig) -> None:
        from ascendserve.loader.generation_config import default_sampling_params
        from ascendserve.loader.model_loader import build_model, eos_token_ids, load_tokenizer
        from ascendserve.worker.kv_budget import plan_kv_cache
        from ascendserve.worker.model_runner import ModelRunner

        self.config = config
        start = time.perf_counter()
        # Every torch call of the engine (loading, KV allocation, forward passes) runs on this one
        # thread, whichever thread drives the engine: a second thread running parallel torch ops
        # gets its own OpenMP team, and with more OpenMP threads than cores libgomp stops spinning
        # between regions, which made a server's decode step 1.5x slower on 2 cores.
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="ascendserve-model")
        if getattr(config.platform, "name", None) == "cpu":
            from ascendserve.platforms.cpu import bind_model_thread
            self._model_thread.submit(bind_model_thread).result()  # VLLM_CPU_OMP_THREADS_BIND, before any torch op
        # SamplingParams fields a request without them gets (the checkpoint's generation_config.json, vLLM's)
        self.default_sampling_params = default_sampling_params(config.model_path, config.args.generation_config,
                                                               config.args.override_generation_config)
        self.tokenizer = load_tokenizer(config.model_path, config.args)
        self.eos_token_ids = eos_token_ids(config.model_path, self.tokenizer, config.hf_config)

        def build_runner() -> ModelRunner:
            model = build_model(config)
            return ModelRunner(config, model, plan_kv_cache(config, model))

        self.runner = self._model_thread.submit(build_runner).result()
        self._model_thread_ident = self._model_thread.submit(threading.get_ident).result()
        num_blocks = self.runner.num_blocks
        self.kv_cache_manager = KVCacheManager(num_blocks, config.args.block_size, config.enable_prefix_caching)
        self.state_cache_manager = (StateCacheManager(self.runner.num_state_slots)
                                    if self.runner.num_state_slots else None)
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len,
                                   config.args.enable_chunked_prefill, self.state_cache_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.vocab_size = config.hf_config.get_text_config().vocab_size
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._ids = itertools.count()
        self._in_flight: tuple[SchedulerOutput, Future] | None = None
        logger.info("Engine ready in %.1f s: %s, dtype %s, device %s, max_model_len %d",
                    time.perf_counter() - start, config.served_model_name, config.dtype,
                    config.device, config.max_model_len)

    def cache_config_info(self) -> dict[str, str]:
        """The KV cache settings as vLLM's CacheConfig.metrics_info() gives them (its field names, values as str): the
        labels of vllm:cache_config_info. vLLM V1 keeps no CPU blocks (num_cpu_blocks 0)."""
        args = self.config.args
        info = {"block_size": args.block_size, "gpu_memory_utilization": args.gpu_memory_utilization,
                "cache_dtype": args.kv_cache_dtype, "is_attention_free": False,
                "num_gpu_blocks_override": args.num_gpu_blocks_override,
                "enable_prefix_caching": self.config.enable_prefix_caching,
                "mamba_cache_dtype": args.mamba_cache_dtype, "mamba_ssm_cache_dtype": args.mamba_ssm_cache_dtype,
                "num_gpu_blocks": self.kv_cache_manager.num_blocks, "num_cpu_blocks": 0,
                "kv_cache_memory_bytes": args.kv_cache_memory_bytes}
        return {key: str(value) for key, value in info.items()}

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        """Resolve the configuration and build the engine."""
        from ascendserve.loader.model_loader import create_engine_config
        return cls(create_engine_config(args))

    # -- requests ------------------------------------------------------------------------------
    def next_request_id(self) -> str:
        """A fresh request id."""
        return str(next(self._ids))

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as str, {"prompt": str} or {"prompt_token_ids": [...]}; a prompt with
        vLLM's multi_modal_data is refused (it used to run as text alone, the images silently dropped)."""
        if isinstance(prompt, dict) and (prompt.get("multi_modal_data") or prompt.get("mm_processor_kwargs")):
            raise ValueError("multi_modal_data: images and video are not processed yet (the vision tower is not "
                             "implemented); this engine runs the text path only")
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            if isinstance(token_ids, (str, bytes)) or not all(
                    isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in token_ids):
                raise ValueError(f"prompt_token_ids must be a list of integer token ids, got {token_ids!r:.80}")
            return prompt.get("prompt"), [int(t) for t in token_ids]
        if isinstance(prompt, dict) and "prompt" not in prompt:
            raise TypeError(f"a prompt dict needs 'prompt' (text) or 'prompt_token_ids', got keys {sorted(prompt)}")
        text = prompt["prompt"] if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise TypeError(f"a prompt must be a str, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                            f"got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass prompt_token_ids with skip_tokenizer_init")
        add_special = prompt.get("add_special_tokens", True) if isinstance(prompt, dict) else True
        return text, self.tokenizer.encode(text, add_special_tokens=add_special)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request (with `params.n` child sequences)."""
        params = params or SamplingParams()
        text, token_ids = self.tokenize_prompt(prompt)
        if params.truncate_prompt_tokens is not None:  # the last k tokens (-1: as many as leave room for one more)
            k = params.truncate_prompt_tokens
            token_ids = token_ids[-(self.config.max_model_len - 1 if k == -1 else k):]
        self.validate_prompt(token_ids)
        params.validate_against(self.vocab_size, self.config.args.max_logprobs)
        if params.stop and self.tokenizer is None:  # no text to find them in
            raise ValueError("stop strings need a tokenizer (the engine runs with skip_tokenizer_init); use "
                             "stop_token_ids")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer (the engine runs with skip_tokenizer_init)")
            params = params.clone()  # the caller's params stay as given
            params.update_from_tokenizer(self.tokenizer)
        max_tokens = self.config.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        children = [Request(f"{i}_{request_id}" if params.n > 1 else request_id, token_ids,
                            _child_params(params, i), self.eos_token_ids, max_tokens, arrival_time, text)
                    for i in range(params.n)]
        if params.prompt_logprobs is not None:  # computed once, by the first child
            children[0].prompt_logprobs = [None] * len(token_ids)
        if params.structured_outputs is not None:
            grammars = self.grammar_compiler.compile(params.structured_outputs, params.n,
                                                     params.structured_outputs_wait_for)
            for child, grammar in zip(children, grammars):
                child.grammar = grammar
        self.output_processor.add_request(request_id, text, children)
        for child in children:
            self.scheduler.add_request(child)

    def validate_prompt(self, token_ids: list[int]) -> None:
        """Raise ValueError for an empty prompt, unknown token ids or one that cannot fit."""
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if len(token_ids) >= self.config.max_model_len:
            raise PromptTooLongError(
                f"the prompt is {len(token_ids)} tokens long, but max_model_len is "
                f"{self.config.max_model_len}: it needs at least one more position to generate")

    def abort_request(self, request_ids, iteration_stats: IterationStats | None = None) -> list[RequestOutput]:
        """Abort user requests (and all their children), freeing their blocks at once; the aborted children go into
        `iteration_stats` when one is given."""
        outputs = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.scheduler.finish_requests(self.output_processor.child_ids(request_id),
                                           RequestStatus.FINISHED_ABORTED)
            output = self.output_processor.abort(request_id, iteration_stats)
            if output is not None:
                outputs.append(output)
        return outputs

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished_requests()

    # -- the loop ------------------------------------------------------------------------------
    def step(self, iteration_stats: IterationStats | None = None) -> list[RequestOutput]:
        """Schedule, run the model once, and return the outputs of the requests that advanced; with `iteration_stats`,
        the step's tokens, latencies and finished sequences are counted into it (the server's metrics)."""
        if self.config.args.async_scheduling:
            return self._step_async(iteration_stats)
        sched = self.scheduler.schedule()
        if sched.is_empty():
            return []
        if threading.get_ident() == self._model_thread_ident:  # the driver's loop runs here (run_loop_on_model_thread)
            result = self.runner.execute_model(sched)
        else:
            result = self._model_thread.submit(self.runner.execute_model, sched).result()
        _record_prompt_logprobs(sched, result)
        updates = self.scheduler.update_from_output(sched, result.sampled_token_ids)
        return self._process(updates, result, iteration_stats)

    def run_loop_on_model_thread(self, loop) -> Future | None:
        """Run a driver's whole step loop (AsyncLLM's) on the model thread, so that each step() calls the model
        directly instead of handing it over and waiting: on two busy cores the hand-off took ~3 ms in most steps of a
        served 64-stream demo run (the model thread woke while the event loop worked and the OpenMP worker spun).
        None with --async-scheduling, whose steps overlap on that thread: the driver then keeps its own thread."""
        if self.config.args.async_scheduling:
            return None
        return self._model_thread.submit(loop)

    def _step_async(self, iteration_stats: IterationStats | None) -> list[RequestOutput]:
        """Schedule and prepare step N+1 while step N runs; return step N's outputs.

        Order: schedule N+1 (decodes of requests sampling in N get a placeholder token) and build its
        metadata -> wait for N -> apply N's tokens to the requests -> fill N+1's placeholders and
        launch it -> detokenize N's outputs while N+1 runs. A request that stops in step N has
        already been scheduled in N+1: that row is computed and discarded. Each request's tokens are
        those of the synchronous loop (greedy, and seeded sampling, whose seed depends only on the
        request and its output length).
        """
        sched = self.scheduler.schedule()
        prepared = None if sched.is_empty() else self.runner.prepare(sched)
        done, self._in_flight = self._in_flight, None
        updates, result = [], None
        if done is not None:
            result = done[1].result()
            _record_prompt_logprobs(done[0], result)
            updates = self.scheduler.update_from_output(done[0], result.sampled_token_ids)
        if prepared is not None:
            sched.fill_placeholders()
            self._in_flight = (sched, self._model_thread.submit(self.runner.execute, prepared))
        return self._process(updates, result, iteration_stats) if result is not None else []

    def _process(self, updates, result, iteration_stats: IterationStats | None) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process(updates, result.logprobs, iteration_stats)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs


def _record_prompt_logprobs(sched: SchedulerOutput, result) -> None:
    """Store a step's prompt logprobs on their requests (before the step's tokens, so that a request's first output
    finds them all)."""
    if result.prompt_logprobs:
        requests = {s.request_id: s.request for s in sched.scheduled}
        for request_id, (first, rows) in result.prompt_logprobs.items():
            requests[request_id].record_prompt_logprobs(first, rows)


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.n == 1:
        return params
    child = params.clone()
    child.n = 1
    if child.seed is not None:
        child.seed = params.seed + index
    return child
