"""Per-request bookkeeping shared by the scheduler, the cache managers and the output processor."""

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ascendserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is; every value from FINISHED_STOPPED on is terminal."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        """True for the terminal states."""
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> str | None:
        """The OpenAI `finish_reason` of a terminal state (None while running)."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being generated.

    `num_computed_tokens` is the single counter that explains every engine path: the tokens of
    `all_token_ids[:num_computed_tokens]` have their KV (and recurrent state) in the cache, or are
    being written by a step already scheduled (the scheduler advances it when it schedules).
    A prefix-cache hit starts it above zero, chunked prefill advances it a chunk at a time, and
    recompute preemption resets it to zero. Example, block_size 4, prompt of 10 tokens, budget 4:
    step 1 computes [0, 4), step 2 [4, 8), step 3 [8, 10) and samples token 10.

    `num_output_placeholders` counts tokens that scheduled steps will sample but whose values are not
    known yet. It is 0 between steps of the synchronous loop; with async scheduling, step N+1 is
    scheduled while step N runs, so a decode of step N+1 computes the placeholder that step N samples.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: "SamplingParams",
                 eos_token_ids: frozenset[int] = frozenset(), max_tokens: int = 16,
                 arrival_time: float | None = None, prompt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first admission; -1 until admitted
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of all_token_ids
        self.first_scheduled_time: float | None = None
        self.grammar = None  # structured outputs: a GrammarState that consumes every generated token
        self.finished_by_grammar = False  # stopped because the grammar ended (not by an EOS / stop token)
        # prompt_logprobs: one row (a LogprobsRow) per prompt token, entry 0 (the first token, which nothing
        # predicts) always None; the prefill chunks fill entries 1, 2, ... in order. None when not asked for, and on
        # every child of an `n` request but the first (they share the prompt).
        self.prompt_logprobs: list | None = None
        self.num_prompt_logprobs = 0  # entries 1..num_prompt_logprobs are filled

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def skips_prefix_cache(self) -> bool:
        """Whether the prefix cache must not be read: prompt logprobs still to compute (a cached block's positions
        would have no logits), or skip_reading_prefix_cache asked for."""
        return self.prompt_logprobs_pending or bool(self.sampling_params.skip_reading_prefix_cache)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Whether prompt logprobs are asked for and some are still to compute (the prefix cache is then skipped:
        a cached block's positions would have no logits)."""
        return self.prompt_logprobs is not None and self.num_prompt_logprobs < self.num_prompt_tokens - 1

    def record_prompt_logprobs(self, first: int, rows: list) -> None:
        """Store the rows of prompt entries first, first + 1, ... (a preempted prefill may compute some twice)."""
        self.prompt_logprobs[first:first + len(rows)] = rows
        self.num_prompt_logprobs = max(self.num_prompt_logprobs, first + len(rows) - 1)

    def append_output_token(self, token_id: int) -> None:
        """Record one sampled token."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def is_finished(self) -> bool:
        """True once the request reached a terminal state."""
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> str | None:
        """`stop`, `length`, `abort` or None."""
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, {self.status.name})")
