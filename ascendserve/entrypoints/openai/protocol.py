"""OpenAI API request and response models, with vLLM's extension fields (pydantic v2)."""

import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_serializer,
                      model_validator)

from ascendserve.engine.structured_output import StructuredOutputsParams
from ascendserve.logger import init_logger

if TYPE_CHECKING:
    from ascendserve.engine.sampling_params import SamplingParams

logger = init_logger(__name__)

# vLLM's bounds for `seed` (a C long).
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
# OpenAI's limit on top_logprobs / logprobs (vLLM's default --max-logprobs).
# vLLM's structured-output options that tune its backends rather than name a constraint: accepted, with a warning.
_STRUCTURED_OUTPUT_OPTIONS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                              "whitespace_pattern", "backend"}
# vLLM's sampling defaults, used when neither the request nor the model's generation config sets one.
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def random_uuid() -> str:
    """A random 32-character hex id."""
    return uuid.uuid4().hex


def make_tool_call_id() -> str:
    """An OpenAI-style tool call id: "call_" and 24 random hex characters."""
    return f"call_{uuid.uuid4().hex[:24]}"


class OpenAIBaseModel(BaseModel):
    """Base of every API model: unknown fields are accepted and ignored, with a warning (as vLLM)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = {name for name in cls.model_fields} | {
                f.alias for f in cls.model_fields.values() if f.alias}
            unknown = sorted(set(data) - known)
            if unknown:
                logger.warning("The following fields were present in the request but ignored: %s", unknown)
        return data


# ----------------------------------------------------------------------------------------------------
# Shared pieces


class ErrorInfo(OpenAIBaseModel):
    """The body of an OpenAI error."""

    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    """An OpenAI error response: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


class PromptTokenUsageInfo(OpenAIBaseModel):
    """Details of the prompt tokens (prefix-cache hits)."""

    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    """Token counts of a request."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class StreamOptions(OpenAIBaseModel):
    """OpenAI's stream_options, with vLLM's continuous_usage_stats."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class FunctionDefinition(OpenAIBaseModel):
    """A function the model may call; `parameters` is a JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    """One entry of a request's `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    """The function named by a `tool_choice` object."""

    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format: `json_object` (any JSON object) or `json_schema` ({"name", "schema", "strict"}),
    enforced by structured outputs; `text` is no constraint. vLLM's `structural_tag` is refused (not implemented)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_format(self):
        if self.type == "structural_tag":
            raise ValueError("response_format type 'structural_tag' is not supported by this server; use "
                             "'json_schema' or 'json_object'.")
        if self.type == "json_schema" and not isinstance((self.json_schema or {}).get("schema"), dict):
            raise ValueError('response_format type \'json_schema\' needs json_schema.schema, a JSON schema object: '
                             '{"type": "json_schema", "json_schema": {"name": "...", "schema": {...}}}')
        return self


class FunctionCall(OpenAIBaseModel):
    """A complete function call: its name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    """A complete tool call in a non-streaming response."""

    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class _StreamDelta(OpenAIBaseModel):
    """A stream delta as OpenAI and vLLM send it: what it does not carry is left out, not null. (Explicit nulls broke
    the openai client's stream helper: a continuation's `"type": null` overwrote the call's "function".)"""

    @model_serializer(mode="wrap")
    def _leave_out_empty(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None and value != []}


class DeltaFunctionCall(_StreamDelta):
    """A piece of a function call in a stream: the name once, then argument fragments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_StreamDelta):
    """A piece of a tool call in a stream; `index` says which call it belongs to."""

    id: str | None = None
    type: Literal["function"] | None = None
    index: int
    function: DeltaFunctionCall | None = None


class ExtractedToolCallInformation(BaseModel):
    """What a tool parser found in a whole model output."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


class _ReasoningMirror(OpenAIBaseModel):
    """Keeps `reasoning` (newer vLLM) and `reasoning_content` (older vLLM, most clients) equal."""

    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _mirror_reasoning(self):
        if self.reasoning is None and self.reasoning_content is not None:
            self.reasoning = self.reasoning_content
        elif self.reasoning_content is None and self.reasoning is not None:
            self.reasoning_content = self.reasoning
        return self


class ChatMessage(_ReasoningMirror):
    """The assistant message of a non-streaming chat choice."""

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaMessage(_ReasoningMirror, _StreamDelta):
    """The new part of the assistant message in one stream chunk (None and no tool calls: left out)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


# ----------------------------------------------------------------------------------------------------
# Logprobs


class ChatCompletionLogProb(OpenAIBaseModel):
    """One token and its log-probability."""

    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    """A sampled token with its most likely alternatives."""

    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    """The logprobs of a chat choice."""

    content: list[ChatCompletionLogProbsContent] | None = None


class PromptLogprob(OpenAIBaseModel):
    """vLLM's Logprob in a response's `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs` of a response: per prompt token (the first null) {token id: its Logprob}
PromptLogprobs = list[dict[int, PromptLogprob] | None]


def clamp_prompt_logprobs(prompt_logprobs) -> PromptLogprobs | None:
    """The engine's prompt logprobs as a response field, -inf raised to OpenAI's floor -9999.0."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {token_id: PromptLogprob(logprob=max(lp.logprob, -9999.0), rank=lp.rank, decoded_token=lp.decoded_token)
             for token_id, lp in entry.items()} for entry in prompt_logprobs]


class CompletionLogProbs(OpenAIBaseModel):
    """The logprobs of a completion choice, in the legacy parallel-list layout."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


# ----------------------------------------------------------------------------------------------------
# Requests


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat and completion requests (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = Field(default_factory=list)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    echo: bool = False
    priority: int = 0
    request_id: str = Field(default_factory=random_uuid)
    # Structured outputs (vLLM): {"json" | "regex" | "choice" | "grammar" | "json_object": ...}, or the older guided_*
    # fields; guided_decoding_backend and guided_whitespace_pattern are accepted and have no effect (one backend here)
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    bad_words: list[str] | None = None
    # vLLM's beam search: `n` beams (the beam width), ranked by cum_logprob / length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true.")
        return self

    @field_validator("priority")
    @classmethod
    def _check_priority(cls, priority: int) -> int:
        if priority != 0:  # vLLM's fcfs scheduler refuses it too
            raise ValueError(f"priority {priority} needs priority scheduling, which this server does not have "
                             f"(requests run first come, first served); leave priority at 0.")
        return priority

    @model_validator(mode="after")
    def _check_structured_outputs(self):
        self.structured_outputs_params()  # a bad combination is a 400 here, naming the fields
        return self

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever field names one (at most one may)."""
        given = {}
        if self.response_format is not None and self.response_format.type == "json_object":
            given["response_format"] = {"json_object": True}
        elif self.response_format is not None and self.response_format.type == "json_schema":
            given["response_format"] = {"json": self.response_format.json_schema["schema"]}
        if self.structured_outputs:
            given["structured_outputs"] = self.structured_outputs
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given[f"guided_{name}"] = {name: value}
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} each constrain the output; give one of them.")
        (field, spec), = given.items()
        self._structured_outputs_field = field
        ignored = sorted(set(spec) & _STRUCTURED_OUTPUT_OPTIONS)
        if ignored:
            logger.warning("%s: %s accepted but has no effect here (one grammar backend, llguidance)", field, ignored)
            spec = {key: value for key, value in spec.items() if key not in _STRUCTURED_OUTPUT_OPTIONS}
        try:
            return StructuredOutputsParams.from_dict(spec)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None

    @property
    def structured_outputs_field(self) -> str | None:
        """The request field the output constraint came from (for error messages), or None."""
        return getattr(self, "_structured_outputs_field", None)

    def _requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def _sampling_logprobs(self) -> int | None:
        raise NotImplementedError

    def _sampling_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def to_sampling_params(self, default_max_tokens: int,
                           default_sampling_params: dict[str, Any] | None = None) -> "SamplingParams":
        """SamplingParams for this request (with beam search, one sequence's: the search runs `n` beams of them).

        `default_max_tokens` is the room left in the context (max_model_len - prompt length).
        `default_sampling_params` holds the model's generation-config defaults (temperature, top_p, top_k,
        min_p, repetition_penalty, max_tokens), used where the request is silent. As in vLLM, max_tokens
        is the smallest of the room, the request's value and the default's.
        """
        from ascendserve.engine.sampling_params import RequestOutputKind, SamplingParams

        defaults = default_sampling_params or {}
        limits = (default_max_tokens, self._requested_max_tokens(), defaults.get("max_tokens"))
        max_tokens = min(v for v in limits if v is not None)

        def pick(name: str) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, _SAMPLING_DEFAULTS[name])

        return SamplingParams(
            n=1 if self.use_beam_search else self.n or 1,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty"),
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=self._sampling_logprobs(),
            prompt_logprobs=self._sampling_prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=self.structured_outputs_params(),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


class ChatCompletionRequest(_SamplingRequest):
    """The body of POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(0, ge=-1)  # -1: the whole vocabulary; upper bound: the server's --max-logprobs
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    parallel_tool_calls: bool | None = True
    reasoning_effort: str | None = None
    # vLLM extensions
    include_reasoning: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = None  # keep the last k tokens of the rendered prompt; -1: max_model_len
    prompt_logprobs: int | None = None  # top tokens per prompt position (-1: all); not with stream

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] has no string 'role'.")
        return messages

    @model_validator(mode="after")
    def _check_chat_fields(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true.")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")
        _check_prompt_options(self)
        self._resolve_tool_choice()
        return self

    def _resolve_tool_choice(self) -> None:
        # OpenAI's defaults: "auto" when tools are given, else "none".
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
            return
        if self.tool_choice == "none":
            return
        if not self.tools:
            raise ValueError(f"tool_choice {self._tool_choice_text()} requires tools to be set.")
        if isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam):
            name = self.tool_choice.function.name
            if name not in {tool.function.name for tool in self.tools}:
                raise ValueError(f"tool_choice names function {name!r}, which is not in tools.")

    def _tool_choice_text(self) -> str:
        choice = self.tool_choice
        return repr(choice) if isinstance(choice, str) else f"{{'function': {choice.function.name!r}}}"

    def _requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def _sampling_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    """The body of POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary; upper bound: the server's --max-logprobs
    suffix: str | None = None
    add_special_tokens: bool = True
    # vLLM extensions
    best_of: int | None = None  # vLLM's V1 engine dropped it: only None or n is accepted
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: max_model_len
    prompt_logprobs: int | None = None  # top tokens per prompt position (-1: all); with echo, logprobs' value
    # OpenAI's legacy default, 16 (vLLM's too); null: the rest of the context. 0 only with echo (the prompt comes back)
    max_tokens: int | None = Field(16, ge=0)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (not prompt or any(p == [] for p in prompt)):
            raise ValueError("prompt must not be an empty list.")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _reject_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported by this server.")
        return suffix

    @model_validator(mode="after")
    def _check_completion_fields(self):
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError(f"best_of is not supported by this server (got best_of={self.best_of}, "
                             f"n={self.n or 1}); use n to get several completions.")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1; 0 is only allowed with echo (the prompt and its "
                             "logprobs come back, nothing is generated).")
        _check_prompt_options(self)
        return self

    @property
    def echo_without_generation(self) -> bool:
        """OpenAI's `echo` with `max_tokens: 0`: the response is the prompt (one token is generated, dropped and not
        counted in usage)."""
        return self.echo and self.max_tokens == 0

    def _requested_max_tokens(self) -> int | None:
        return 1 if self.echo_without_generation else self.max_tokens

    def _sampling_logprobs(self) -> int | None:
        return self.logprobs

    def _sampling_prompt_logprobs(self) -> int | None:
        # echo with logprobs returns the prompt tokens' logprobs too (vLLM's rule)
        return self.logprobs if self.prompt_logprobs is None and self.echo else self.prompt_logprobs


def _check_prompt_options(request: ChatCompletionRequest | CompletionRequest) -> None:
    """vLLM's prompt extensions that chat and completions share: truncate_prompt_tokens and prompt_logprobs."""
    k = request.truncate_prompt_tokens
    if k is not None and k < 1 and k != -1:
        raise ValueError(f"truncate_prompt_tokens must be >= 1, or -1 for the model's max_model_len; got {k}.")
    k = request.prompt_logprobs
    if k is not None and request.stream and (k > 0 or k == -1):  # vLLM's rule; echo's own are streamed
        raise ValueError("prompt_logprobs are not available when stream is true.")


class TokenizeCompletionRequest(OpenAIBaseModel):
    """The body of POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    """The body of POST /tokenize with chat messages (rendered by the chat template first)."""

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    return_token_strs: bool | None = False


def _tokenize_kind(body: Any) -> str:
    """The one model a /tokenize body is validated against: the chat one when it has `messages` and no `prompt`.

    A plain union tried both, and the chat model's check logged `prompt` as an ignored field on every prompt
    request. The tags are the class names, which errors.py drops from an error's field path: `{}` is "'prompt' is
    a required field", `{"messages": []}` names `messages`.
    """
    if isinstance(body, dict):
        chat = "messages" in body and "prompt" not in body
    else:
        chat = hasattr(body, "messages")
    return "TokenizeChatRequest" if chat else "TokenizeCompletionRequest"


TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
                            | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
                            Discriminator(_tokenize_kind)]


class TokenizeResponse(OpenAIBaseModel):
    """The answer to /tokenize."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    """The body of POST /detokenize."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    """The answer to /detokenize."""

    prompt: str


# ----------------------------------------------------------------------------------------------------
# Responses


class ChatCompletionResponseChoice(OpenAIBaseModel):
    """One choice of a non-streaming chat response."""

    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    """A non-streaming chat response."""

    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    """One choice of a chat stream chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    """One chunk of a chat stream."""

    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class CompletionResponseChoice(OpenAIBaseModel):
    """One choice of a non-streaming completion response."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIBaseModel):
    """A non-streaming completion response."""

    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionResponseStreamChoice(OpenAIBaseModel):
    """One choice of a completion stream chunk."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    """One chunk of a completion stream."""

    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class ModelPermission(OpenAIBaseModel):
    """OpenAI's (legacy) model permission record, as vLLM returns it."""

    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    """One served model in GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ascendserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    """The answer to GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
