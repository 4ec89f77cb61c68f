"""POST /v1/chat/completions: chat template, reasoning and tool-call parsing, streamed or not."""

import time

from fastapi import Request

from ascendserve.engine.outputs import Logprob
from ascendserve.engine.structured_output import StructuredOutputsParams
from ascendserve.entrypoints.openai.chat_utils import (TOOL_CALL_OPENINGS, call_name_text, forced_call_grammar,
                                                       normalize_messages, render_chat, single_token_tags)
from ascendserve.entrypoints.openai.errors import OpenAIError
from ascendserve.entrypoints.openai.protocol import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                                     ChatCompletionLogProbsContent, ChatCompletionRequest,
                                                     ChatCompletionResponse, ChatCompletionResponseChoice,
                                                     ChatCompletionResponseStreamChoice,
                                                     ChatCompletionStreamResponse, ChatMessage, DeltaMessage,
                                                     UsageInfo, clamp_prompt_logprobs)
from ascendserve.entrypoints.openai.serving_engine import (ChoiceState, OpenAIServing, SSEResponse,
                                                           merge_async_iterators, run_until_disconnected, sse,
                                                           sse_error)

_MIN_LOGPROB = -9999.0


class ChatChoiceParser:
    """Turns one choice's text deltas into DeltaMessages: reasoning first, then content and tool calls.

    The reasoning parser sees the whole output; once it reports the reasoning over, only the content
    part goes on to the tool parser, which therefore starts from an empty text. `prefix` is text the
    prompt already holds on the model's behalf (a forced tool-call opening): the tool parser sees it
    as the first content. Concatenating every delta's content/reasoning/arguments gives what `parse()`
    returns for the whole output.
    """

    def __init__(self, request: ChatCompletionRequest, reasoning_parser=None, tool_parser=None,
                 prefix: str = "", forced: bool = False) -> None:
        self.request = request
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.prefix = prefix
        self.forced = forced or bool(prefix)  # tool_choice required / named: a reply must call a given tool
        self.in_reasoning = reasoning_parser is not None and not prefix
        self.text, self.token_ids = "", []  # the whole output so far
        self.content_text, self.content_ids = "", []  # what the tool parser has seen

    @property
    def called_names(self) -> list[str]:
        """Names of the calls the tool parser has emitted."""
        return [call["name"] for call in self.tool_parser.prev_tool_call_arr] if self.tool_parser else []

    @property
    def tools_called(self) -> bool:
        """Whether the tool parser has emitted a call."""
        return bool(self.tool_parser is not None and self.tool_parser.prev_tool_call_arr)

    def feed(self, delta_text: str, delta_ids: list[int]) -> DeltaMessage | None:
        """The DeltaMessage of one engine delta, or None when nothing is ready to send."""
        reasoning, content, content_ids = None, delta_text, list(delta_ids)
        previous_text, previous_ids = self.text, self.token_ids
        self.text, self.token_ids = previous_text + delta_text, previous_ids + list(delta_ids)
        if self.in_reasoning:
            parser = self.reasoning_parser
            dm = parser.extract_reasoning_streaming(previous_text, self.text, delta_text, previous_ids,
                                                    self.token_ids, delta_ids)
            reasoning = (dm.reasoning_content or dm.reasoning) if dm else None
            content = (dm.content or "") if dm else ""
            if parser.reasoning_ended:
                self.in_reasoning = False
                content_ids = parser.extract_content_ids(list(delta_ids))
            else:
                content, content_ids = "", []
        if self.prefix and not self.content_text:
            content = self.prefix + content
        tool_calls = []
        if self.tool_parser is not None and (content or content_ids):
            previous, previous_ids = self.content_text, self.content_ids
            self.content_text, self.content_ids = previous + content, previous_ids + content_ids
            dm = self.tool_parser.extract_tool_calls_streaming(previous, self.content_text, content, previous_ids,
                                                               self.content_ids, content_ids, self.request)
            content = (dm.content or "") if dm else ""
            tool_calls = self._allowed_calls(dm.tool_calls if dm else [])
        return _delta(reasoning if self.request.include_reasoning else None, content, tool_calls)

    def _allowed_calls(self, calls: list) -> list:
        """`parallel_tool_calls: false`: the first call only (vLLM's filter; a stream's deltas of index 0)."""
        if self.request.parallel_tool_calls is False:
            return [call for call in calls if call.index == 0]
        return calls

    def finish(self) -> DeltaMessage | None:
        """What the parsers held back, flushed at the end of the output."""
        if self.tool_parser is None:
            return None
        if self.prefix and not self.content_text:
            self.content_text = self.prefix
        dm = self.tool_parser.finish_streaming(self.content_text, self.request)
        return _delta(None, (dm.content or "") if dm else "", self._allowed_calls(dm.tool_calls if dm else []))

    def parse(self, text: str) -> ChatMessage:
        """The whole message of a finished output (non-streaming)."""
        reasoning, content = None, text
        if self.in_reasoning:
            reasoning, content = self.reasoning_parser.extract_reasoning(text, self.request)
        content = self.prefix + (content or "")
        if self.tool_parser is None:
            message = ChatMessage(content=content or None, reasoning_content=reasoning)
        else:
            info = self.tool_parser.extract_tool_calls(content, self.request)
            calls = info.tool_calls[:1] if self.request.parallel_tool_calls is False else info.tool_calls
            message = ChatMessage(content=info.content, tool_calls=calls, reasoning_content=reasoning)
        if not self.request.include_reasoning:
            message.reasoning = message.reasoning_content = None
        return message


def _delta(reasoning: str | None, content: str, tool_calls: list) -> DeltaMessage | None:
    fields = {}
    if reasoning:
        fields["reasoning_content"] = reasoning
    if content:
        fields["content"] = content
    if tool_calls:
        fields["tool_calls"] = tool_calls
    return DeltaMessage(**fields) if fields else None


class OpenAIServingChat(OpenAIServing):
    """The /v1/chat/completions handler."""

    def __init__(self, engine, models, options, reasoning_parser_cls=None, tool_parser_cls=None) -> None:
        super().__init__(engine, models, options)
        self.reasoning_parser_cls = reasoning_parser_cls
        self.tool_parser_cls = tool_parser_cls
        self.call_tag_tokens = single_token_tags(self.tokenizer) if self.tokenizer is not None else {}

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request | None = None):
        """A ChatCompletionResponse, or an SSEResponse when `stream` is set."""
        model = self.admit(request)
        opening = self._check_tool_choice(request)
        prompt_text = self._render(request)
        prompt_ids = await self.tokenize(prompt_text, request.add_special_tokens)
        # A reasoning model whose prompt leaves the thinking open thinks first, then every constraint (a forced call's
        # too, opening included: vLLM's order) holds from the token after its end; else a forced call's opening goes
        # into the prompt (`prefix`, which the model continues).
        thinking_end = self._reasoning_end_token(request, prompt_ids)
        prefix = opening if thinking_end is None else ""
        if prefix:
            prompt_text += prefix
            prompt_ids += self.tokenizer.encode(prefix, add_special_tokens=False)
        prompt_ids = self.truncate_prompt(request, prompt_ids)
        self.check_waiting_limit()
        params = self.sampling_params(request, len(prompt_ids), "messages")
        if opening:  # one forced call (or more: required), held to the tools' schemas; its grammar's end ends it
            params.structured_outputs = self._forced_call_grammar(request, lead=None if prefix else opening)
        if params.structured_outputs is not None:
            params.structured_outputs_wait_for = thinking_end
        request_id = self.response_id("chatcmpl", request, raw_request)
        parsers = [self._choice_parser(request, prompt_ids, prefix, forced=bool(opening))
                   for _ in range(request.n or 1)]
        stream = await self.add(request_id, {"prompt": prompt_text, "prompt_token_ids": prompt_ids}, params,
                                "messages", request.structured_outputs_field or "tool_choice",
                                self.beam_search_params(request, params))
        if request.stream:
            return SSEResponse(self._stream(request, model, request_id, prompt_ids, stream, parsers), [stream])
        try:
            return await run_until_disconnected(
                self._collect(request, model, request_id, prompt_ids, stream, parsers), raw_request)
        finally:
            stream.abort()

    # -- request checks and rendering ----------------------------------------------------------
    def _check_tool_choice(self, request: ChatCompletionRequest) -> str:
        """Validate tool_choice against the server flags; return the forced call opening, if any."""
        choice = request.tool_choice
        if not request.tools or choice == "none":
            return ""
        parser = self.options.tool_call_parser
        if choice == "auto":
            if not (self.options.enable_auto_tool_choice and self.tool_parser_cls is not None):
                raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                  'to be set', 400, param="tool_choice")
            return ""
        if self.tool_parser_cls is None or parser not in TOOL_CALL_OPENINGS:
            raise OpenAIError(f"tool_choice {choice if isinstance(choice, str) else 'with a named function'!r} "
                              f"needs a tool-call parser that supports forced calls "
                              f"({', '.join(sorted(TOOL_CALL_OPENINGS))}); start the server with "
                              f"--tool-call-parser (this server has {parser or 'none'}).", 400,
                              param="tool_choice")
        named, opening = TOOL_CALL_OPENINGS[parser]
        if isinstance(choice, str) and len(request.tools) > 1:  # "required": the model picks the function
            return opening
        name = choice.function.name if not isinstance(choice, str) else request.tools[0].function.name
        try:
            return named.format(name=call_name_text(parser, name))
        except ValueError as e:
            raise OpenAIError(str(e), 400, param="tools") from None

    def _forced_call_grammar(self, request: ChatCompletionRequest, lead: str | None) -> StructuredOutputsParams:
        """`required` / named tool_choice: the grammar that holds the forced call to the tools' schemas (the name to one
        of them, the arguments to its parameters), as vLLM's guided decoding does; from the opening `lead` on, or
        (None) from after the opening the prompt holds."""
        if request.structured_outputs_field is not None:
            raise OpenAIError(f"tool_choice {request._tool_choice_text()} already constrains the output to a tool "
                              f"call; {request.structured_outputs_field} cannot be given with it.", 400,
                              param=request.structured_outputs_field)
        choice, tools = request.tool_choice, [tool.function for tool in request.tools]
        if not isinstance(choice, str):
            name = choice.function.name
        else:  # "required": one tool is named in the opening, several are left to the grammar
            name = tools[0].name if len(tools) == 1 else None
        definitions = [{"name": t.name, "parameters": t.parameters} for t in tools if name is None or t.name == name]
        # "required": one call or more (vLLM's), unless parallel calls are off; a named function: that one call
        repeat = isinstance(choice, str) and request.parallel_tool_calls is not False
        try:
            grammar = forced_call_grammar(self.options.tool_call_parser, definitions, name, repeat, lead,
                                          self.call_tag_tokens)
        except ValueError as e:
            raise OpenAIError(str(e), 400, param="tools") from None
        return StructuredOutputsParams(grammar=grammar)

    def _reasoning_end_token(self, request: ChatCompletionRequest, prompt_ids: list[int]) -> int | None:
        """Structured outputs leave a reasoning model's thinking free: the token that ends it, where the prompt leaves
        it open and the server has a reasoning parser (vLLM's rule), else None (constrained from the first token)."""
        if self.reasoning_parser_cls is None:
            return None
        parser = self.reasoning_parser_cls(self.tokenizer, request.chat_template_kwargs)
        return None if parser.is_reasoning_end(prompt_ids) else getattr(parser, "end_token_id", None)

    def _render(self, request: ChatCompletionRequest) -> str:
        if request.chat_template is not None and not self.options.trust_request_chat_template:
            raise OpenAIError("Chat template is passed with request, but --trust-request-chat-template is not "
                              "set. Refused request with untrusted chat template.", 400, param="chat_template")
        # --default-chat-template-kwargs under the request's own (the reasoning parser reads the merged ones too)
        request.chat_template_kwargs = {**(self.options.default_chat_template_kwargs or {}),
                                        **(request.chat_template_kwargs or {})} or None
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        if getattr(request, "tool_choice", None) == "none" and self.options.exclude_tools_when_tool_choice_none:
            tools = None
        text = render_chat(self.tokenizer, request.messages,
                           chat_template=request.chat_template or self.options.chat_template, tools=tools,
                           add_generation_prompt=request.add_generation_prompt,
                           continue_final_message=request.continue_final_message,
                           documents=getattr(request, "documents", None),
                           chat_template_kwargs=request.chat_template_kwargs)
        return text

    def _choice_parser(self, request: ChatCompletionRequest, prompt_ids: list[int], prefix: str,
                       forced: bool = False) -> ChatChoiceParser:
        reasoning = None
        if self.reasoning_parser_cls is not None and not prefix:
            reasoning = self.reasoning_parser_cls(self.tokenizer, request.chat_template_kwargs)
            if reasoning.is_reasoning_end(prompt_ids):
                # enable_thinking=False closed it in the prompt; or continue_final_message carries on an assistant
                # turn whose thinking the template closed
                reasoning = None
        tool = None
        if self.tool_parser_cls is not None and request.tools and request.tool_choice != "none":
            tool = self.tool_parser_cls(self.tokenizer)
        return ChatChoiceParser(request, reasoning, tool, prefix, forced)

    def _echo(self, request: ChatCompletionRequest) -> str:
        """`echo`: the last message's text (content parts joined, as rendered) when it is the assistant's."""
        last = request.messages[-1]
        if request.echo and last.get("role") == "assistant":
            return normalize_messages([last])[0]["content"]
        return ""

    # -- responses ----------------------------------------------------------------------------
    async def _collect(self, request, model, request_id, prompt_ids, stream, parsers) -> ChatCompletionResponse:
        choices = [ChoiceState() for _ in parsers]
        prompt_logprobs = None
        async for _, output in merge_async_iterators(stream):
            prompt_logprobs = output.prompt_logprobs or prompt_logprobs
            for c in output.outputs:
                choice = choices[c.index]
                choice.text += c.text
                choice.token_ids += c.token_ids
                choice.logprobs += c.logprobs or []
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        result = []
        echo = self._echo(request)
        for index, (choice, parser) in enumerate(zip(choices, parsers)):
            message = parser.parse(choice.text)
            names = [c.function.name for c in message.tool_calls]
            self._check_forced_call(request, parser, names, choice.finish_reason)
            if echo:
                message.content = echo + (message.content or "")
            finish = _finish_reason(choice.finish_reason, bool(message.tool_calls))
            logprobs = self._logprobs(request, choice.token_ids, choice.logprobs)
            result.append(ChatCompletionResponseChoice(index=index, message=message, logprobs=logprobs,
                                                       finish_reason=finish, stop_reason=choice.stop_reason))
        num_generated = sum(len(c.token_ids) for c in choices)
        usage = UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=num_generated,
                          total_tokens=len(prompt_ids) + num_generated)
        return ChatCompletionResponse(id=request_id, model=model, choices=result, usage=usage,
                                      prompt_logprobs=clamp_prompt_logprobs(prompt_logprobs))

    def _check_forced_call(self, request, parser: ChatChoiceParser, names: list[str],
                           finish_reason: str | None) -> None:
        """`required` / named tool_choice: a reply without a call to a given tool is an error, never text. The grammar
        makes every finished call parse; one cut short by max_tokens is returned as it is, with finish_reason
        "length" (as vLLM). A 400, as vLLM's: a 5xx has clients retry it (the openai client twice), generating it again.
        Where the grammar holds the call the model can only end its turn before it: in its thinking."""
        known = {tool.function.name for tool in request.tools or []}
        if parser.forced and finish_reason != "length" and (not names or not set(names) <= known):
            raise OpenAIError(f"tool_choice {request._tool_choice_text()} requires a tool call, but the model ended "
                              f"its turn without a call to one of the given tools (a thinking model can end it before "
                              f"its thinking does; chat_template_kwargs {{\"enable_thinking\": false}} makes it call "
                              f"at once).", 400, param="tool_choice")

    def _logprobs(self, request, token_ids, logprobs) -> ChatCompletionLogProbs | None:
        if not request.logprobs:
            return None
        return chat_logprobs(token_ids, logprobs, request.top_logprobs or 0, self.tokenizer)

    async def _stream(self, request, model, request_id, prompt_ids, stream, parsers):
        created = int(time.time())
        n = len(parsers)
        num_tokens = [0] * n
        include_usage, continuous = self.stream_usage(request)

        def chunk(index, delta, logprobs=None, finish=None, stop_reason=None):
            out = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[
                ChatCompletionResponseStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish,
                                                   stop_reason=stop_reason)])
            if continuous:
                out.usage = _usage(prompt_ids, sum(num_tokens))
            return sse(out)

        try:
            for index in range(n):
                yield chunk(index, DeltaMessage(role="assistant", content=self._echo(request) or None))
            async for _, output in merge_async_iterators(stream):
                for c in output.outputs:
                    parser = parsers[c.index]
                    num_tokens[c.index] += len(c.token_ids)
                    delta = parser.feed(c.text, c.token_ids)
                    logprobs = self._logprobs(request, c.token_ids, c.logprobs or [])
                    if c.finish_reason is not None:
                        tail = parser.finish()
                        delta = _merge(delta, tail)
                        self._check_forced_call(request, parser, parser.called_names, c.finish_reason)
                        finish = _finish_reason(c.finish_reason, parser.tools_called)
                        yield chunk(c.index, delta or DeltaMessage(), logprobs, finish, c.stop_reason)
                    elif delta is not None or logprobs is not None:
                        yield chunk(c.index, delta or DeltaMessage(), logprobs)
            if include_usage:
                yield sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                       usage=_usage(prompt_ids, sum(num_tokens))))
        except Exception as e:
            yield sse_error(e)
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"


def _merge(first: DeltaMessage | None, second: DeltaMessage | None) -> DeltaMessage | None:
    if first is None or second is None:
        return first or second
    return DeltaMessage(reasoning_content=(first.reasoning_content or "") + (second.reasoning_content or "") or None,
                        content=(first.content or "") + (second.content or "") or None,
                        tool_calls=first.tool_calls + second.tool_calls)


def _finish_reason(engine_reason: str | None, called: bool) -> str | None:
    if called and engine_reason in ("stop", None):
        return "tool_calls"
    return engine_reason


def _usage(prompt_ids: list[int], num_generated: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=num_generated,
                     total_tokens=len(prompt_ids) + num_generated)


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int,
                  tokenizer) -> ChatCompletionLogProbs:
    """OpenAI chat logprobs: each sampled token with its `num_top` most likely alternatives."""
    content = []
    for token_id, step in zip(token_ids, logprobs):
        sampled = step.get(token_id) or Logprob(float("-inf"))
        top = sorted(step.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)[:num_top]
        content.append(ChatCompletionLogProbsContent(
            token=_text(sampled, token_id, tokenizer), logprob=max(sampled.logprob, _MIN_LOGPROB),
            bytes=list(_text(sampled, token_id, tokenizer).encode("utf-8", errors="replace")),
            top_logprobs=[ChatCompletionLogProb(token=_text(lp, tid, tokenizer), logprob=max(lp.logprob, _MIN_LOGPROB),
                                                bytes=list(_text(lp, tid, tokenizer).encode("utf-8", errors="replace")))
                          for tid, lp in top]))
    return ChatCompletionLogProbs(content=content)


def _text(logprob: Logprob, token_id: int, tokenizer) -> str:
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"
