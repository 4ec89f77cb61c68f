"""POST /v1/completions: one or several prompts, `n` samples each, streamed or not."""

import time

from fastapi import Request

from ascendserve.engine.outputs import Logprob
from ascendserve.entrypoints.openai.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                                     CompletionResponseChoice, CompletionResponseStreamChoice,
                                                     CompletionStreamResponse, UsageInfo, clamp_prompt_logprobs)
from ascendserve.entrypoints.openai.serving_engine import (ChoiceState, OpenAIServing, SSEResponse, abort_all,
                                                           merge_async_iterators, run_until_disconnected, sse,
                                                           sse_error)

# OpenAI's floor for a logprob that is -inf.
_MIN_LOGPROB = -9999.0


class OpenAIServingCompletion(OpenAIServing):
    """The /v1/completions handler."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request | None = None):
        """A CompletionResponse, or an SSEResponse when `stream` is set."""
        model = self.admit(request)
        prompts = await self._prompts(request)
        base_id = self.response_id("cmpl", request, raw_request)
        streams = []
        self.check_waiting_limit()
        try:
            for i, (text, ids) in enumerate(prompts):
                params = self.sampling_params(request, len(ids), "prompt")
                prompt = {"prompt_token_ids": ids, "prompt": text}
                streams.append(await self.add(f"{base_id}-{i}", prompt, params, "prompt",
                                              request.structured_outputs_field,
                                              self.beam_search_params(request, params)))
        except BaseException:
            abort_all(streams)
            raise
        n = request.n or 1
        if request.stream:
            return SSEResponse(self._stream(request, model, base_id, prompts, streams, n), streams)
        try:
            return await run_until_disconnected(self._collect(request, model, base_id, prompts, streams, n),
                                                raw_request)
        finally:
            abort_all(streams)

    async def _prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            items = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        out = []
        for item in items:
            text = item if isinstance(item, str) else None
            ids = await self.tokenize(text, request.add_special_tokens) if text is not None else list(item)
            kept = self.truncate_prompt(request, ids)
            # A text prompt that lost tokens echoes what the model saw; token ids are decoded only for echo, once
            # the engine checked them.
            out.append((text if len(kept) == len(ids) else None, kept))
        return out

    def _echo(self, request: CompletionRequest, prompts, prompt_index: int) -> str:
        if not request.echo:
            return ""
        text, ids = prompts[prompt_index]
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(ids)
        return text or ""

    def _logprobs(self, request, token_ids, logprobs, offset: int, echoed=None) -> CompletionLogProbs | None:
        """The logprobs lists of generated tokens (text offsets from `offset`), after those of the echoed prompt when
        `echoed` = (prompt token ids, the engine's prompt logprobs) is given: its offsets count from 0 and its first
        token has null logprobs (vLLM's layout)."""
        if request.logprobs is None:
            return None
        out = completion_logprobs(token_ids, logprobs, request.logprobs, self.tokenizer, offset)
        if echoed is None:
            return out
        ids, prompt_logprobs = echoed
        head = completion_logprobs(ids, prompt_logprobs or [None] * len(ids), request.logprobs, self.tokenizer)
        return CompletionLogProbs(text_offset=head.text_offset + out.text_offset,
                                  token_logprobs=head.token_logprobs + out.token_logprobs,
                                  tokens=head.tokens + out.tokens, top_logprobs=head.top_logprobs + out.top_logprobs)

    async def _collect(self, request, model, base_id, prompts, streams, n) -> CompletionResponse:
        choices = [ChoiceState() for _ in range(len(prompts) * n)]
        prompt_logprobs = [None] * len(prompts)
        async for i, output in merge_async_iterators(*streams):
            if output.prompt_logprobs is not None:
                prompt_logprobs[i] = output.prompt_logprobs
            for c in output.outputs:
                choice = choices[i * n + c.index]
                choice.text += c.text
                choice.token_ids += c.token_ids
                choice.logprobs += c.logprobs or []
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        result = []
        only_echo = request.echo_without_generation
        for index, choice in enumerate(choices):
            i = index // n
            echo = self._echo(request, prompts, i)
            echoed = (prompts[i][1], prompt_logprobs[i]) if request.echo else None
            generated = ([], []) if only_echo else (choice.token_ids, choice.logprobs)
            logprobs = self._logprobs(request, *generated, len(echo), echoed)
            result.append(CompletionResponseChoice(index=index, text=echo + ("" if only_echo else choice.text),
                                                   logprobs=logprobs, finish_reason=choice.finish_reason,
                                                   stop_reason=choice.stop_reason,
                                                   prompt_logprobs=clamp_prompt_logprobs(prompt_logprobs[i])))
        return CompletionResponse(id=base_id, model=model, choices=result,
                                  usage=_usage(prompts, choices, only_echo))

    async def _stream(self, request, model, base_id, prompts, streams, n):
        created = int(time.time())
        choices = [ChoiceState() for _ in range(len(prompts) * n)]
        include_usage, continuous = self.stream_usage(request)
        prompt_logprobs = [None] * len(prompts)
        only_echo = request.echo_without_generation
        try:
            async for i, output in merge_async_iterators(*streams):
                if output.prompt_logprobs is not None:
                    prompt_logprobs[i] = output.prompt_logprobs
                for c in output.outputs:
                    index = i * n + c.index
                    choice = choices[index]
                    echo, echoed = "", None
                    if not choice.started:
                        choice.started = True
                        echo = self._echo(request, prompts, i)
                        echoed = (prompts[i][1], prompt_logprobs[i]) if request.echo else None
                    generated = ([], [], "") if only_echo else (c.token_ids, c.logprobs or [], c.text)
                    text = echo + generated[2]
                    # choice.text is the choice's returned text so far, echo included: text_offset counts from
                    # its start, so a token's offset is the same as in the non-streaming response.
                    offset = len(choice.text) + len(echo)
                    choice.text += text
                    choice.token_ids += c.token_ids
                    if not text and not c.token_ids and c.finish_reason is None:
                        continue
                    logprobs = self._logprobs(request, *generated[:2], offset, echoed)
                    chunk = CompletionStreamResponse(
                        id=base_id, created=created, model=model,
                        choices=[CompletionResponseStreamChoice(index=index, text=text, logprobs=logprobs,
                                                                finish_reason=c.finish_reason,
                                                                stop_reason=c.stop_reason)])
                    if continuous:
                        chunk.usage = _usage(prompts, choices, only_echo)
                    yield sse(chunk)
            if include_usage:
                yield sse(CompletionStreamResponse(id=base_id, created=created, model=model, choices=[],
                                                   usage=_usage(prompts, choices, only_echo)))
        except Exception as e:
            yield sse_error(e)
        finally:
            abort_all(streams)
        yield "data: [DONE]\n\n"


def _usage(prompts, choices, only_echo: bool) -> UsageInfo:
    """The request's usage; echo with max_tokens 0 returns no generated token (the one it ran is dropped) and
    counts none."""
    num_prompt = sum(len(ids) for _, ids in prompts)
    num_generated = 0 if only_echo else sum(len(choice.token_ids) for choice in choices)
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                     total_tokens=num_prompt + num_generated)


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int,
                        tokenizer, initial_offset: int = 0) -> CompletionLogProbs:
    """The legacy parallel-list layout: tokens, token_logprobs, top_logprobs (top `num_top` + sampled); a None step
    (an echoed prompt's first token) has null logprobs."""
    out = CompletionLogProbs()
    offset = initial_offset
    for token_id, step in zip(token_ids, logprobs):
        if step is None:  # the first prompt token: nothing predicts it
            token = _token_text(Logprob(0.0), token_id, tokenizer)
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(token)
            continue
        sampled = step.get(token_id) or Logprob(float("-inf"))
        token = _token_text(sampled, token_id, tokenizer)
        out.tokens.append(token)
        out.token_logprobs.append(max(sampled.logprob, _MIN_LOGPROB))
        out.text_offset.append(offset)
        offset += len(token)
        top = sorted(step.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)[:num_top]
        entry = {_token_text(lp, tid, tokenizer): max(lp.logprob, _MIN_LOGPROB) for tid, lp in top}
        entry.setdefault(token, max(sampled.logprob, _MIN_LOGPROB))
        out.top_logprobs.append(entry)
    return out


def _token_text(logprob: Logprob, token_id: int, tokenizer) -> str:
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"
