"""Sampling parameters for text generation, with vLLM's fields, defaults and checks (no torch)."""

import copy
import math
import os
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from functools import cached_property

from ascendserve.engine.structured_output import StructuredOutputsParams
from ascendserve.logger import init_logger

logger = init_logger(__name__)

# Below this temperature a request is greedy (vLLM's `_SAMPLING_EPS`).
_SAMPLING_EPS = 1e-5
# Positive temperatures are raised to at least this, so that logits / T stays finite.
_MIN_TEMPERATURE = 1e-2
# OpenAI clamps each logit_bias value to this range.
_MAX_ABS_LOGIT_BIAS = 100.0


class SamplingType(IntEnum):
    """How the next token of a request is chosen."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(Enum):
    """What each streamed RequestOutput holds."""

    # The whole output so far, every time.
    CUMULATIVE = 0
    # Only what is new since the previous output.
    DELTA = 1
    # Nothing until the request finishes.
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Per-request sampling parameters, as vLLM's `SamplingParams` (OpenAI completion fields)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Words never to generate (vLLM's): a word's last token is masked where the output ends with the rest of it
    bad_words: list[str] | None = None
    # A grammar the output follows (StructuredOutputsParams), as vLLM's `structured_outputs`;
    # `structured_outputs_wait_for`: a token id (a reasoning model's </think>) after which the grammar starts
    structured_outputs: StructuredOutputsParams | None = None
    structured_outputs_wait_for: int | None = None
    # Keep only the prompt's last k tokens (-1: the last max_model_len - 1), as vLLM's
    truncate_prompt_tokens: int | None = None
    # Compute the prompt again rather than reading the prefix cache (vLLM's; prompt_logprobs do so anyway)
    skip_reading_prefix_cache: bool | None = None
    # vLLM's, accepted: guided_decoding is structured_outputs' older name; extra_args (read by custom logits
    # processors) and flat_logprobs (a container choice) change nothing here; per-request logits_processors (which
    # vLLM's V1 engine dropped too) are refused
    guided_decoding: StructuredOutputsParams | dict | None = None
    extra_args: dict | None = None
    flat_logprobs: bool = False
    logits_processors: list | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Characters the detokenizer holds back so that a stop string is never streamed out.
    output_text_buffer_length: int = field(default=0, init=False)
    # The token ids of each bad word, with and without a leading space (update_from_tokenizer; vLLM's rule)
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._normalize()
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            self._normalize_greedy()

    def _normalize(self) -> None:
        # Below _SAMPLING_EPS is greedy; between it and _MIN_TEMPERATURE is raised, as vLLM does.
        if _SAMPLING_EPS <= self.temperature < _MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, which may give nan or inf logits; "
                           "raised to %s.", self.temperature, _MIN_TEMPERATURE, _MIN_TEMPERATURE)
            self.temperature = _MIN_TEMPERATURE
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:
            self.seed = None
        if self.logprobs is True:
            self.logprobs = 1
        self.stop = _to_stop_list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None and not all(isinstance(w, str) for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}.")
        if self.logit_bias is not None:
            self.logit_bias = _to_logit_bias(self.logit_bias)
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("guided_decoding is structured_outputs' older name; give one of them.")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.logits_processors:
            raise ValueError("logits_processors: per-request logits processors are not supported (vLLM's V1 engine "
                             "dropped them too); use logit_bias, allowed_token_ids, bad_words or structured_outputs.")
        if isinstance(self.structured_outputs, dict):  # vLLM's dict form: {"json": {...}} etc.
            try:
                self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
            except ValueError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be a StructuredOutputsParams or vLLM's dict form such as "
                            f"{{'json': schema}}, got {type(self.structured_outputs).__name__}")

    def _verify_args(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        max_n = max_n_sequences()
        if self.n > max_n:  # each child is a request: an unbounded n would fill memory before anything runs
            raise ValueError(f"n must be at most {max_n} (VLLM_MAX_N_SEQUENCES), got {self.n}.")
        self._verify_penalties()
        self._verify_truncation()
        self._verify_lengths()
        self._verify_outputs()

    def _verify_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")

    def _verify_truncation(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None:
            _check_int("seed", self.seed)

    def _verify_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to "
                             f"max_tokens={self.max_tokens}, got {self.min_tokens}.")

    def _verify_outputs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if value < -1:
                    raise ValueError(f"{name} must be non-negative or -1 (whole vocabulary), got {value}.")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id)
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 (max_model_len), got {k!r}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True; set detokenize=True to use stop.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty when given.")
            for token_id in self.allowed_token_ids:
                _check_int("allowed_token_ids", token_id)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")

    def _normalize_greedy(self) -> None:
        # Zero temperature is greedy: the truncation knobs cannot change an argmax.
        self.top_p = 1.0
        self.top_k = 0
        self.min_p = 0.0
        if self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

    def validate_against(self, vocab_size: int, max_logprobs: int = -1) -> None:
        """Raise ValueError if a token id field, logprobs or prompt_logprobs exceeds a `vocab_size` vocabulary, or
        logprobs / prompt_logprobs (-1: the whole vocabulary) asks for more than `max_logprobs` (-1: no cap)."""
        fields = {
            "logit_bias": list(self.logit_bias or ()),
            "allowed_token_ids": self.allowed_token_ids or [],
            "stop_token_ids": self.stop_token_ids,
        }
        for name, token_ids in fields.items():
            bad = [t for t in token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary "
                                 f"[0, {vocab_size - 1}]: {bad[:10]}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab_size}, got {value}.")
            requested = vocab_size if value == -1 else value
            if requested is not None and max_logprobs != -1 and requested > max_logprobs:
                shown = f"-1 (the whole vocabulary: {vocab_size})" if value == -1 else value
                raise ValueError(f"{name}: requested {shown} logprobs per token, but at most {max_logprobs} "
                                 f"are allowed (max_logprobs; -1 lifts the cap).")

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """vLLM's: the fields given as None take their defaults."""
        return cls(**{name: value for name, value in kwargs.items() if value is not None})

    def update_from_generation_config(self, generation_config: dict, model_eos_token_id: int | None = None) -> None:
        """vLLM's: a generation_config.json's eos_token_id(s) other than the model's own become stop token ids (unless
        ignore_eos)."""
        eos = generation_config.get("eos_token_id")
        if eos is None or self.ignore_eos:
            return
        ids = {eos} if isinstance(eos, int) else set(eos)
        ids.discard(model_eos_token_id)
        self.stop_token_ids = sorted(set(self.stop_token_ids) | ids)

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenize `bad_words` (vLLM's rule): each word alone, and after a space where that gives a different first
        token and as many tokens (the word inside a text), so both forms are kept from the output."""
        words = []
        for word in self.bad_words or ():
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if alone:
                words.append(alone)
            if spaced and (not alone or (spaced[0] != alone[0] and len(spaced) == len(alone))):
                words.append(spaced)
        self.bad_words_token_ids = words

    @cached_property
    def sampling_type(self) -> SamplingType:
        """GREEDY below temperature 1e-5, else RANDOM_SEED when seeded, else RANDOM."""
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is the argmax of the processed logits."""
        return self.sampling_type == SamplingType.GREEDY

    @property
    def all_stop_token_ids(self) -> set[int]:
        """The stop token ids as a set; the engine adds the model's eos ids separately."""
        return set(self.stop_token_ids)

    def clone(self) -> "SamplingParams":
        """Return an independent deep copy."""
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in _REPR_FIELDS)
        return f"SamplingParams({shown})"


_REPR_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "skip_special_tokens", "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "bad_words",
    "truncate_prompt_tokens", "output_kind",
)


def max_n_sequences() -> int:
    """vLLM's cap on `n`: VLLM_MAX_N_SEQUENCES, 16384 unless set; ValueError naming it for a value that is not a
    positive integer (`serve` reads it at start-up, so a typo stops the server, not every request)."""
    value = os.environ.get("VLLM_MAX_N_SEQUENCES", "16384")
    try:
        max_n = int(value)
    except ValueError:
        max_n = 0
    if max_n < 1:
        raise ValueError(f"VLLM_MAX_N_SEQUENCES must be a positive integer (the most sequences one request's n may "
                         f"ask for; 16384 unless set), got {value!r}")
    return max_n


def _check_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).")


def _to_stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    stop = list(stop)
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"stop must be a string or a list of strings, got {s!r} in it.")
    return stop


def _to_logit_bias(logit_bias: dict) -> dict[int, float]:
    # JSON object keys are strings: {"50256": -100} means token id 50256.
    converted: dict[int, float] = {}
    for key, bias in logit_bias.items():
        try:
            token_id = int(key)
            bias = float(bias)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map integer token ids to numbers, "
                             f"got {key!r}: {bias!r}.") from None
        if not math.isfinite(bias):
            raise ValueError(f"logit_bias values must be finite, got {key!r}: {bias}.")
        converted[token_id] = min(_MAX_ABS_LOGIT_BIAS, max(-_MAX_ABS_LOGIT_BIAS, bias))
    return converted
