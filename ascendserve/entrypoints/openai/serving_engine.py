"""What chat and completions share: admission checks, sampling params, SSE framing, disconnects."""

import asyncio
import concurrent.futures
import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.responses import StreamingResponse

from ascendserve.engine.beam_search import BeamSearch, BeamSearchParams
from ascendserve.engine.outputs import CompletionOutput, RequestOutput
from ascendserve.engine.sampling_params import RequestOutputKind, SamplingParams, max_n_sequences
from ascendserve.engine.structured_output import GRAMMAR_ERROR_PREFIX
from ascendserve.entrypoints.openai.errors import OpenAIError, error_body
from ascendserve.entrypoints.openai.protocol import random_uuid
from ascendserve.entrypoints.openai.serving_models import ServingModels
from ascendserve.logger import init_logger

logger = init_logger(__name__)

# Seconds a client is asked to wait (Retry-After) when the waiting queue is full.
RETRY_AFTER_S = 1

# Prompts of at least this many characters are tokenized on the tokenizer thread (the Rust tokenizer lets go of the
# GIL), so a long prompt (~100 ms for 50k tokens) does not stall every other stream's event loop; shorter ones cost
# less than the hop.
OFF_LOOP_TOKENIZE_CHARS = 4096
_tokenizer_pool: concurrent.futures.ThreadPoolExecutor | None = None


@dataclass
class ChoiceState:
    """One choice being accumulated (non-streaming) or tracked (streaming)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False


@dataclass
class ServerOptions:
    """The server flags the request handlers read (everything else lives in EngineArgs)."""

    max_waiting_requests: int | None = None
    max_logprobs: int = 20  # -1: no cap
    log_requests: bool = False  # --enable-log-requests
    max_log_len: int | None = None  # characters (token ids) of a logged prompt; None: all
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    default_sampling_params: dict[str, Any] | None = None
    default_chat_template_kwargs: dict[str, Any] | None = None  # under each request's chat_template_kwargs
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none": the template is not shown the tools
    enable_force_include_usage: bool = False  # every stream ends with a usage chunk, asked for or not


class OpenAIServing:
    """Base of the chat and completion handlers.

    `engine` is an AsyncLLM or anything with its surface: `add_request()` (awaits admission, returns
    an async iterator of RequestOutputs with `abort()`), `tokenizer`, `config.max_model_len`,
    `num_waiting` and `errored`.
    """

    def __init__(self, engine, models: ServingModels, options: ServerOptions) -> None:
        self.engine = engine
        self.models = models
        self.options = options
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len

    @staticmethod
    def response_id(prefix: str, request, raw_request: Request | None) -> str:
        """vLLM's response id: `prefix` + "-" + the X-Request-Id header, else the body's request_id (a fresh uuid
        when the client sent none)."""
        header = raw_request.headers.get("x-request-id") if raw_request is not None else None
        return f"{prefix}-{header or request.request_id}"

    def admit(self, request) -> str:
        """The model name to answer with; raise 404 for an unknown model, 503 when overloaded."""
        name = self.models.check_model(request.model)
        if self.engine.errored:
            raise OpenAIError("The engine has failed and cannot serve requests; restart the server.", 503)
        if getattr(self.engine, "shutting_down", False):
            raise OpenAIError("The server is shutting down and takes no new requests; send it to another replica.",
                              503)
        self.check_waiting_limit()
        return name

    def check_waiting_limit(self) -> None:
        """503 over --max-waiting-requests. Checked on arrival, and again just before a request's first add (the
        tokenizer thread may have let others in meanwhile): nothing awaits between that check and the engine counting
        the add as pending."""
        limit = self.options.max_waiting_requests
        if limit is not None and self.engine.num_waiting >= limit:
            raise OpenAIError(f"The server is overloaded: {self.engine.num_waiting} requests are waiting "
                              f"(--max-waiting-requests {limit}); retry later.", 503,
                              headers={"Retry-After": str(RETRY_AFTER_S)})

    def stream_usage(self, request) -> tuple[bool, bool]:
        """(a usage chunk ends the stream, every chunk carries usage): stream_options, or --enable-force-include-usage
        for the first."""
        options = request.stream_options
        include = self.options.enable_force_include_usage or bool(options and options.include_usage)
        return include, bool(include and options and options.continuous_usage_stats)

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of a text prompt; a long one is tokenized off the event loop (OFF_LOOP_TOKENIZE_CHARS)."""
        global _tokenizer_pool
        if self.tokenizer is None:
            raise OpenAIError("This server runs without a tokenizer (--skip-tokenizer-init): "
                              "send token ids, not text.", 400, param="prompt")
        encode = functools.partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        if len(text) < OFF_LOOP_TOKENIZE_CHARS:
            return encode()
        if _tokenizer_pool is None:  # one thread: requests are tokenized in arrival order, as vLLM's pool of one
            _tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ascendserve-tokenizer")
        return await asyncio.get_running_loop().run_in_executor(_tokenizer_pool, encode)

    def truncate_prompt(self, request, token_ids: list[int]) -> list[int]:
        """The prompt the engine sees under vLLM's `truncate_prompt_tokens` k: its last k ids (left truncation,
        before the context-length check), all of them when k is unset; -1 means k = max_model_len.

        [5, 6, 7, 8] with k=2 -> [7, 8]; a k above max_model_len is a 400 even for a shorter prompt (as vLLM).
        """
        k = getattr(request, "truncate_prompt_tokens", None)
        if k is None:
            return token_ids
        if k > self.max_model_len:
            raise OpenAIError(f"truncate_prompt_tokens ({k}) is greater than this model's maximum context length "
                              f"({self.max_model_len}); use a smaller value, or -1 for {self.max_model_len}.", 400,
                              param="truncate_prompt_tokens")
        return token_ids[-(self.max_model_len if k == -1 else k):]

    def sampling_params(self, request, num_prompt_tokens: int, input_name: str) -> SamplingParams:
        """SamplingParams (DELTA outputs) after the context-length and logprobs checks; 400 on a bad value."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise OpenAIError(f"This model's maximum context length is {limit} tokens. However, your request "
                              f"has {num_prompt_tokens} input tokens. Please reduce the length of the "
                              f"{input_name}.", 400, param=input_name)
        requested = request._requested_max_tokens()
        if requested is not None and num_prompt_tokens + requested > limit:
            param = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {input_name}, "
                f"{requested} in the completion). Please reduce the length of the {input_name} or "
                f"completion.", 400, param=param)
        try:
            params = request.to_sampling_params(limit - num_prompt_tokens, self.options.default_sampling_params)
        except ValueError as e:
            raise OpenAIError(str(e), 400, param=_param_in(str(e))) from None
        logprobs_field = "top_logprobs" if getattr(request, "top_logprobs", None) else "logprobs"
        # echo's prompt logprobs come from logprobs
        prompt_field = "prompt_logprobs" if request.prompt_logprobs is not None else "logprobs"
        cap = self.options.max_logprobs  # -1: none
        for value, name in ((params.logprobs, logprobs_field), (params.prompt_logprobs, prompt_field)):
            if value is not None and cap != -1 and (value == -1 or value > cap):
                shown = "-1 (the whole vocabulary)" if value == -1 else value
                raise OpenAIError(f"{name}: requested {shown} logprobs per token, but this server allows at most "
                                  f"{cap} (--max-logprobs).", 400, param=name)
        params.output_kind = RequestOutputKind.DELTA
        return params

    def beam_search_params(self, request, params: SamplingParams) -> BeamSearchParams | None:
        """vLLM's beam search of a request with use_beam_search: `n` beams, the rest from its sampling params."""
        if not request.use_beam_search:
            return None
        width = request.n or 1
        if params.structured_outputs is not None:  # the search's steps would drop it: output off the schema
            constraint = getattr(request, "structured_outputs_field", None) or "tool_choice"
            raise OpenAIError(f"use_beam_search: beam search does not follow a grammar, and this request has one "
                              f"({constraint}); drop use_beam_search or the constraint.", 400,
                              param="use_beam_search")
        max_n = max_n_sequences()
        if width > max_n:  # every beam is a sequence of each step, as each child of n is
            raise OpenAIError(f"n: beam search with {width} beams runs {width} sequences at once, but at most "
                              f"{max_n} are allowed (VLLM_MAX_N_SEQUENCES).", 400, param="n")
        if -1 < self.options.max_logprobs < 2 * width:
            raise OpenAIError(f"n: beam search with {width} beams ranks 2 x {width} = {2 * width} logprobs a step, but "
                              f"this server allows at most {self.options.max_logprobs} (--max-logprobs).", 400,
                              param="n")
        return BeamSearchParams(beam_width=width, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                temperature=params.temperature, length_penalty=request.length_penalty,
                                include_stop_str_in_output=params.include_stop_str_in_output)

    async def add(self, request_id: str, prompt: dict, params: SamplingParams, input_name: str,
                  constraint_field: str | None = None, beam: BeamSearchParams | None = None):
        """Queue one prompt (with `beam`, a beam search over it); a ValueError from the engine's checks becomes a 400
        naming the field at fault (a grammar that does not compile: `constraint_field`, the request field it came
        from)."""
        if self.options.log_requests:
            log_request(request_id, prompt, params, self.options.max_log_len)
        if beam is not None:  # the search's steps are added as it runs
            return BeamSearchStream(self.engine, request_id, prompt["prompt_token_ids"], beam,
                                    params.logprobs is not None, params.prompt_logprobs)
        try:
            # the engine's id is unique even when clients reuse an X-Request-Id (vLLM's suffix)
            return await self.engine.add_request(f"{request_id}-{random_uuid()[:8]}", prompt, params)
        except ValueError as e:
            grammar = constraint_field if str(e).startswith(GRAMMAR_ERROR_PREFIX) else None
            raise OpenAIError(str(e), 400, param=_param_in(str(e)) or grammar or input_name) from None


class BeamSearchStream:
    """An engine stream's surface (an async iterator of RequestOutputs, `abort()`) over a beam search the server runs:
    each step adds one request a live beam (one token, 2 x beam_width logprobs); one output comes, the best beams as
    `n` finished choices, text without a final EOS (vLLM's)."""

    def __init__(self, engine, request_id: str, prompt_ids: list[int], params: BeamSearchParams,
                 logprobs: bool, prompt_logprobs: int | None = None) -> None:
        self.engine, self.request_id, self.prompt_ids = engine, request_id, prompt_ids
        self.params, self.logprobs, self.prompt_logprobs = params, logprobs, prompt_logprobs
        self.finished = False
        self._steps: list = []  # the engine streams of the step running

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        self.finished = True
        eos = self.engine.eos_token_ids
        search = BeamSearch([self.prompt_ids], self.params, eos, self.engine.config.max_model_len)
        prompt_logprobs, aborted = None, False
        try:
            while (batch := search.pending()) and not getattr(self.engine, "shutting_down", False):
                step_id = f"{self.request_id}-{search.steps}-{random_uuid()[:8]}"
                step_params = search.step_params
                if search.steps == 0 and self.prompt_logprobs is not None:  # the first step's one beam is the prompt
                    step_params = step_params.clone()
                    step_params.prompt_logprobs = self.prompt_logprobs
                self._steps = []
                for i, tokens in enumerate(batch):
                    self._steps.append(await self.engine.add_request(f"{step_id}-{i}", {"prompt_token_ids": tokens},
                                                                     step_params))
                outputs = await asyncio.gather(*(_last_output(s) for s in self._steps))
                prompt_logprobs = prompt_logprobs or outputs[0].prompt_logprobs
                if any(o is None or o.outputs[0].finish_reason == "abort" or not o.outputs[0].logprobs
                       for o in outputs):  # a step aborted (shutdown, or the engine): the beams so far end here
                    aborted = True
                    break
                search.advance(outputs)
            aborted = aborted or bool(search.pending())  # stopped by a shutdown
        finally:
            self.abort()
        start, tokenizer = len(self.prompt_ids), self.engine.tokenizer
        choices = []
        for i, beam in enumerate(search.results()[0]):
            tokens = beam.tokens[start:]
            shown = tokens[:-1] if beam.finish_reason == "stop" else tokens
            text = tokenizer.decode(shown, skip_special_tokens=True) if tokenizer is not None else ""
            choices.append(CompletionOutput(i, text, tokens, beam.cum_logprob, beam.logprobs if self.logprobs else None,
                                            "abort" if aborted else beam.finish_reason, beam.stop_reason))
        return RequestOutput(self.request_id, None, self.prompt_ids, choices, True, prompt_logprobs=prompt_logprobs)

    def abort(self) -> None:
        """Stop the search: the step's requests are aborted."""
        self.finished = True
        for stream in self._steps:
            stream.abort()
        self._steps = []


async def _last_output(stream):
    last = None
    async for output in stream:
        last = output
    return last


_PARAM_NAMES = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "max_tokens",
                "min_tokens", "logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words",
                "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt"}


def log_request(request_id: str, prompt: dict, params, max_log_len: int | None) -> None:
    """--enable-log-requests, as vLLM's RequestLogger: the sampling parameters whole at INFO; the prompt's text and
    token ids at DEBUG, each cut to --max-log-len (characters, token ids)."""
    token_ids = prompt.get("prompt_token_ids") or []
    logger.info("Received request %s: %d prompt tokens, params: %r", request_id, len(token_ids), params)
    clip = slice(max_log_len)
    logger.debug("Request %s prompt: %r, prompt_token_ids: %s", request_id, (prompt.get("prompt") or "")[clip],
                 list(token_ids[clip]))


def _param_in(message: str) -> str | None:
    """The field a SamplingParams/engine message starts with ("top_k must be ..." -> "top_k")."""
    first = message.split(" ", 1)[0].strip(":'\".,")
    return first if first in _PARAM_NAMES else None


async def merge_async_iterators(*iterators) -> AsyncIterator[tuple[int, Any]]:
    """Yield (i, item) from several async iterators as items arrive; closing it cancels the rest."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()


async def run_until_disconnected(coro, raw_request: Request | None):
    """Await `coro`, cancelling it (which aborts its requests) if the client goes away first."""
    if raw_request is None:
        return await coro
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise OpenAIError("The client disconnected before the response was ready.", 499)
    finally:
        watcher.cancel()
        task.cancel()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


def abort_all(streams) -> None:
    """Abort every request stream that has not finished (idempotent)."""
    for stream in streams:
        stream.abort()


def sse(data) -> str:
    """One server-sent event: `data: {...}\\n\\n`."""
    if not isinstance(data, str):
        data = data.model_dump_json(exclude_unset=False) if hasattr(data, "model_dump_json") else json.dumps(data)
    return f"data: {data}\n\n"


def sse_error(exc: BaseException) -> str:
    """The event a stream sends when it fails after the 200 has gone out."""
    status = exc.status if isinstance(exc, OpenAIError) else 500
    message = exc.message if isinstance(exc, OpenAIError) else f"{type(exc).__name__}: {exc}"
    return sse(json.dumps(error_body(message, status)))


class SSEResponse(StreamingResponse):
    """A text/event-stream response that aborts its requests however it ends.

    Closing the generator is not enough: a generator that never started (the client left before the
    first byte) runs no `finally`, so `streams` are aborted here as well.
    """

    media_type = "text/event-stream"

    def __init__(self, content, streams) -> None:
        super().__init__(content)
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            abort_all(self.streams)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
