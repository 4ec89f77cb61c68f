"""AsyncLLM: the synchronous LLMEngine driven by a background thread, with one asyncio queue per request.

Threading model (the invariant that keeps it simple): ONLY the engine thread touches the LLMEngine.
That thread is the engine's model thread (so a step runs the model with no hand-off), or, with
--async-scheduling (whose steps overlap on the model thread), a thread of its own.
The asyncio side talks to it through a FIFO inbox of commands (add, abort) and gets results back
through `loop.call_soon_threadsafe`. Because the inbox is FIFO, an abort sent after an add is always
applied after it, so a request cancelled while its add is still queued is still aborted, and its
blocks are freed before the next step.

    generate() --add--> inbox --> engine thread: add_request / abort_request / step()
        ^                                 |
        +---- per-request asyncio.Queue <-+ (RequestOutput, or the engine's exception)
"""

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ascendserve.config import ARRIVAL_WINDOW_CAP
from ascendserve.engine.outputs import RequestOutput
from ascendserve.engine.sampling_params import SamplingParams
from ascendserve.logger import init_logger
from ascendserve.metrics import IterationStats, SchedulerStats

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; every pending and future request gets this error."""


@dataclass
class _Stream:
    """Engine-thread state of one user request: where its outputs go."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival_time: float


@dataclass
class _Add:
    stream: _Stream
    prompt: object
    params: SamplingParams
    done: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str | None  # None: every request


class AsyncLLM:
    """Async front of an LLMEngine: `generate()` yields RequestOutputs; cancelling it aborts the request."""

    def __init__(self, engine, metrics=None, arrival_window_ms: float | None = None) -> None:
        self.engine = engine
        if arrival_window_ms is None:
            arrival_window_ms = engine.config.args.arrival_window_ms
        self.arrival_window_s = arrival_window_ms / 1000
        self.metrics = metrics  # ascendserve.metrics.EngineMetrics or None
        if metrics is not None:
            metrics.log_engine_initialized(engine.cache_config_info())
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self.dead_error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stats = SchedulerStats()  # last snapshot, written by the engine thread
        self._iteration = IterationStats()  # engine thread: what happened since the last publish
        self._pending_adds = 0  # adds sent but not yet counted by a snapshot
        self._blocked = 0  # sequences the last step left waiting
        self._num_added = 0  # engine thread: adds applied since the last snapshot
        self._lock = threading.Lock()
        self.shutting_down = False  # set by begin_shutdown(): no new requests
        self._stopping = threading.Event()  # set by shutdown(), or when the interpreter exits
        # The loop runs on the engine's model thread where the engine offers it (then step() calls the model
        # directly, with no hand-off), else on a daemon thread of its own.
        start = getattr(engine, "run_loop_on_model_thread", None)
        self._loop = start(self._run) if start is not None else None
        self._thread = None
        if self._loop is None:
            self._thread = threading.Thread(target=self._run, name="ascendserve-engine", daemon=True)
            self._thread.start()
        else:
            # The model thread is no daemon: the interpreter's exit joins it, so the loop must end by then even if
            # shutdown() was never called. threading's exit hooks run just before that join (concurrent.futures
            # stops its own workers with one); this one holds the two events, not the engine.
            threading._register_atexit(_set_all, self._stopping, self._wake)

    @classmethod
    def from_engine_args(cls, args, metrics=None) -> "AsyncLLM":
        """Build the LLMEngine (blocking, in the calling thread) and start its loop."""
        from ascendserve.engine.llm_engine import LLMEngine
        return cls(LLMEngine.from_engine_args(args), metrics)

    # -- the asyncio side ----------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's stop ids (a server-side beam search ends beams at them)."""
        return self.engine.eos_token_ids

    @property
    def errored(self) -> bool:
        """True once the engine loop has failed."""
        return self.dead_error is not None

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a slot, with requests not yet handed to the engine; while the last step scheduled
        every waiting sequence, less the running slots (`max_num_seqs`) still free: a burst that the next step starts
        at once waits for nothing."""
        waiting = self._stats.num_waiting + self._pending_adds
        if self._blocked:  # the last step left requests waiting: the KV cache or the token budget holds them back
            return waiting
        return max(waiting - max(self.engine.scheduler.max_num_seqs - self._stats.num_running, 0), 0)

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The snapshot taken after the last engine step."""
        return self._stats

    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          arrival_time: float | None = None) -> "RequestStream":
        """Queue a request; returns once the engine accepted it (bad input raises ValueError here)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop has failed: {self.dead_error!r}")
        loop = asyncio.get_running_loop()
        stream = _Stream(request_id, loop, asyncio.Queue(), arrival_time or time.time())
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending_adds += 1
        self._send(_Add(stream, prompt, params, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self._send(_Abort(request_id))  # the inbox is FIFO: applied after the add
            raise
        return RequestStream(self, request_id, stream.queue)

    async def generate(self, prompt, params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until it finishes.

        Bad input raises ValueError before the first output. Leaving the iterator early (break,
        cancellation, client disconnect) aborts the request at once.
        """
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once; its iterator ends with finish_reason 'abort')."""
        self._send(_Abort(request_id))

    def begin_shutdown(self) -> None:
        """From now on the server refuses new requests (OpenAIServing.admit); those in flight run on or are aborted."""
        self.shutting_down = True

    def abort_all(self) -> None:
        """Abort every request in the engine (thread-safe, returns at once): each iterator ends with finish_reason
        'abort'. The server's shutdown uses it (--shutdown-timeout)."""
        self._send(_Abort(None))

    def shutdown(self) -> None:
        """Stop the engine loop after the current step, and wait for it (at most 30 s)."""
        _set_all(self._stopping, self._wake)
        if self._thread is not None:
            self._thread.join(timeout=30)
            return
        try:
            self._loop.result(timeout=30)
        except Exception:  # a loop that raised or still runs; a thread would have printed its error itself
            logger.exception("The engine loop did not end cleanly")

    def _send(self, command) -> None:
        self._inbox.put(command)
        self._wake.set()

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.clear()  # before the checks: a stop or a command that comes after them ends the idle wait
            if self._stopping.is_set():
                break
            try:
                self._iterate()
            except BaseException as e:  # the engine state is unknown now: fail everything
                if self.dead_error is None:
                    logger.exception("Engine loop failed; every request gets the error")
                    self._die(e)
        self._die(EngineDeadError("the engine was shut down"))
        self._drain_inbox()  # fail adds that raced with the shutdown

    def _iterate(self) -> None:
        """Apply queued commands, then run one step (or sleep until a command arrives)."""
        self._drain_inbox()
        self._snapshot()
        with self._lock:  # only now, once the snapshot counts them as waiting
            self._pending_adds -= self._num_added
            self._num_added = 0
        if self.dead_error is not None or not self.engine.has_unfinished_requests():
            self._publish(time.time())
            self._wake.wait()
            self._await_arrivals()
            return
        deliveries = self._route(self.engine.step(self._iteration))
        self._iteration.engine_step = True
        self._publish(time.time())  # before delivering: a caller that sees its output sees it counted too
        _deliver_all(deliveries)

    def _await_arrivals(self) -> None:
        """Woken from idle: wait while commands keep arriving (each gap shorter than the arrival window, for at
        most ARRIVAL_WINDOW_CAP windows), so that requests sent together go into the first step together. Without
        it a burst's first request was prefilled alone and the others waited for that step (BENCHMARKS.md run 55:
        8 concurrent demo requests, TTFT 0.6 s for the first, 4.2 s for the other seven)."""
        if self.arrival_window_s <= 0:
            return
        deadline = time.monotonic() + ARRIVAL_WINDOW_CAP * self.arrival_window_s
        seen = self._inbox.qsize()
        while not self._stopping.is_set() and time.monotonic() < deadline:
            time.sleep(self.arrival_window_s)
            if self._inbox.qsize() == seen:
                return
            seen = self._inbox.qsize()

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._num_added += 1
                self._add(command)
            elif self.dead_error is None:
                ids = list(self._streams) if command.request_id is None else command.request_id
                _deliver_all(self._route(self.engine.abort_request(ids, self._iteration)))

    def _add(self, command: _Add) -> None:
        stream = command.stream
        if not command.done.set_running_or_notify_cancel():
            return  # the caller was cancelled while the add waited: nothing to add (its abort is a no-op)
        try:
            if self.dead_error is not None:
                raise EngineDeadError(f"the engine loop has failed: {self.dead_error!r}")
            if stream.request_id in self._streams:
                raise ValueError(f"request id {stream.request_id!r} is already in use")
            self.engine.add_request(stream.request_id, command.prompt, command.params, stream.arrival_time)
        except Exception as e:
            command.done.set_exception(e)
        else:
            self._streams[stream.request_id] = stream
            command.done.set_result(None)

    def _route(self, outputs: list[RequestOutput]) -> dict[asyncio.AbstractEventLoop, list]:
        """Group outputs by their caller's event loop; forget finished requests."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        return by_loop

    def _die(self, error: BaseException) -> None:
        self.dead_error = self.dead_error or error
        dead = EngineDeadError(f"the engine loop has failed: {error!r}")
        dead.__cause__ = error
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream in self._streams.values():
            by_loop.setdefault(stream.loop, []).append((stream.queue, dead))
        self._streams.clear()
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver, items)

    def _snapshot(self) -> None:
        if self.dead_error is not None:
            return
        engine = self.engine
        kv = engine.kv_cache_manager
        self._stats = SchedulerStats(
            num_running=len(engine.scheduler.running), num_waiting=len(engine.scheduler.waiting),
            kv_cache_usage=kv.usage(), num_preemptions=engine.scheduler.num_preemptions,
            prefix_cache_requests=kv.num_queried_requests, prefix_cache_queries=kv.num_queries,
            prefix_cache_hits=kv.num_hits)

    def _publish(self, now: float) -> None:
        self._snapshot()
        self._blocked = self._stats.num_waiting  # after a step: what it could not schedule
        iteration, self._iteration = self._iteration, IterationStats()
        if self.metrics is not None:
            self.metrics.record(self._stats, iteration, now)


class RequestStream:
    """The outputs of one accepted request, as an async iterator; `abort()` (idempotent) cancels it.

    Cancelling a task that waits in `__anext__` aborts the request too.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, outputs: asyncio.Queue) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._outputs = outputs

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._outputs.get()
        except BaseException:
            self.abort()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


def _set_all(*events: threading.Event) -> None:
    for event in events:
        event.set()


def _deliver(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


def _deliver_all(by_loop: dict) -> None:
    """Hand each event loop its (queue, output) pairs in one callback."""
    for loop, items in by_loop.items():
        _call_soon(loop, _deliver, items)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass
