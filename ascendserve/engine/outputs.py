"""What `LLM.generate` returns: vLLM's RequestOutput / CompletionOutput / Logprob shapes."""

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log probability of one token, its 1-based rank in the vocabulary and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One of the `n` sequences generated for a prompt."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: None = None  # vLLM's field; no LoRA here

    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request (all of its `n` sequences) after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: None = None  # vLLM V1 leaves it None too (request metrics go to /metrics)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None, each the token's Logprob and its
    # top tokens' (as the sampled logprobs); a DELTA stream carries them in its first output
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # vLLM's fields for features this engine does not have (LoRA, encoder-decoder models, multimodal, KV transfer)
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    multi_modal_placeholders: dict = field(default_factory=dict)
    kv_transfer_params: None = None
