"""Engine updates -> RequestOutputs: detokenize, cut stop strings, gather logprobs, merge `n` children; and, when asked,
each child's token counts and latencies for the metrics (vLLM's OutputProcessor fills IterationStats the same way)."""

import time
from dataclasses import dataclass, field

from ascendserve.engine.detokenizer import IncrementalDetokenizer, decode_token
from ascendserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from ascendserve.engine.request import Request
from ascendserve.engine.sampling_params import RequestOutputKind, SamplingParams
from ascendserve.engine.scheduler import RequestUpdate
from ascendserve.metrics import IterationStats, RequestStateStats


@dataclass
class _ChildState:
    """Output-side state of one generated sequence."""

    index: int
    parent_id: str
    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    stats: RequestStateStats  # its own timings: metrics count each child as a request
    sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finish_sent: bool = False  # a DELTA output carried finish_reason (each child sends it once)


@dataclass
class _ParentState:
    """A user request: `n` children sharing one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_ChildState] = field(default_factory=list)
    # Kept up to date as children finish, so that a step's cost follows the children it touched, not `n`
    num_unfinished: int = 0
    # vLLM's RequestOutput.prompt_logprobs (entry 0 None), once the first child computed them all; a DELTA output
    # carries them once
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False

    def finished(self) -> bool:
        return self.num_unfinished == 0

    def finish(self, child: _ChildState, reason: str | None, stop_reason: int | str | None = None) -> bool:
        """Record a child's finish (once: a later call changes nothing and returns False)."""
        if child.finish_reason is not None or reason is None:
            return False
        child.finish_reason, child.stop_reason = reason, stop_reason
        self.num_unfinished -= 1
        return True


class OutputProcessor:
    """Keeps per-request output state and turns each step's updates into RequestOutputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self.child_to_parent: dict[str, _ChildState] = {}

    def add_request(self, parent_id: str, prompt: str | None, children: list[Request]) -> None:
        """Register a user request and its child sequences (already queued in the scheduler)."""
        first = children[0]
        parent = _ParentState(parent_id, prompt, first.prompt_token_ids, first.sampling_params)
        for index, child in enumerate(children):
            state = _ChildState(index, parent_id, child, self._detokenizer(child), None, None,
                                RequestStateStats(child.arrival_time))
            if child.sampling_params.logprobs is not None:
                state.logprobs, state.cumulative_logprob = [], 0.0
            parent.children.append(state)
            self.child_to_parent[child.request_id] = state
        parent.num_unfinished = len(children)
        self.parents[parent_id] = parent

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer | None:
        params = request.sampling_params
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens, stop=params.stop or (),
            include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)

    def child_ids(self, parent_id: str) -> list[str]:
        """Scheduler request ids of a user request's children."""
        parent = self.parents.get(parent_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def process(self, updates: list[RequestUpdate], logprobs: dict, iteration_stats: IterationStats | None = None
                ) -> tuple[list[RequestOutput], list[str]]:
        """RequestOutputs for the touched user requests, and child ids newly stopped by a stop string; the step's
        tokens, latencies and finished children go into `iteration_stats` when one is given."""
        touched: dict[str, list[_ChildState]] = {}  # parent id -> its children this step, parents in first-touched order
        stopped_by_string = []
        now = time.time()
        for update in updates:
            state = self.child_to_parent.get(update.request.request_id)
            if state is None:
                continue
            if self._apply(state, update, logprobs.get(update.request.request_id), iteration_stats, now):
                stopped_by_string.append(update.request.request_id)
            touched.setdefault(state.parent_id, []).append(state)
        outputs = [self._make_output(self.parents[p], children) for p, children in touched.items()]
        return [o for o in outputs if o is not None], stopped_by_string

    def abort(self, parent_id: str, iteration_stats: IterationStats | None = None) -> RequestOutput | None:
        """Mark every unfinished child aborted (counted in `iteration_stats` when given) and return the final
        output."""
        parent = self.parents.get(parent_id)
        if parent is None:
            return None
        now = time.time()
        for child in parent.children:
            self._finish(parent, child, "abort", None, iteration_stats, now)
        return self._make_output(parent)

    def _finish(self, parent: _ParentState, child: _ChildState, reason: str | None, stop_reason: int | str | None,
                iteration_stats: IterationStats | None, now: float) -> None:
        """Record a child's finish; in `iteration_stats` the child, and the parent once its last child finished."""
        if not parent.finish(child, reason, stop_reason) or iteration_stats is None:
            return
        request = child.request
        # request.max_tokens is the max_tokens asked for, capped by the room max_model_len leaves: what vLLM's server
        # puts in the request's sampling params (the request's max_tokens, or that room when it has none)
        iteration_stats.update_from_finished_request(child.stats, reason, request.num_prompt_tokens, request.max_tokens,
                                                     request.first_scheduled_time, now)
        if parent.finished():
            iteration_stats.update_from_finished_parent(
                len(parent.children), max(c.stats.num_generation_tokens for c in parent.children))

    def _apply(self, state: _ChildState, update: RequestUpdate, row, iteration_stats: IterationStats | None,
               now: float) -> bool:
        request = update.request
        parent = self.parents[state.parent_id]
        if iteration_stats is not None:
            iteration_stats.update_from_output(state.stats, len(update.new_token_ids), request.num_prompt_tokens, now)
        if row is not None and state.logprobs is not None:
            state.logprobs.append(self._logprob_dict(row, request.sampling_params.detokenize))
            state.cumulative_logprob += row.logprobs[0]
        stop_str = None
        if state.detokenizer is not None:
            # the last token is an EOS / stop token id (not a grammar's last token, which is text)
            stop_terminated = (update.finished and request.get_finish_reason() == "stop"
                               and not request.finished_by_grammar)
            stop_str = state.detokenizer.update(update.new_token_ids, stop_terminated)
        if stop_str is not None:  # also when the same token reached max_tokens: the stop string wins (vLLM's)
            self._finish(parent, state, "stop", stop_str, iteration_stats, now)
            return not update.finished
        if update.finished:
            self._finish(parent, state, request.get_finish_reason(), request.stop_reason, iteration_stats, now)
        return False

    def _logprob_dict(self, row, decode: bool) -> dict[int, Logprob]:
        """A LogprobsRow as vLLM's {token id: Logprob}; each token's text unless `decode` is off (detokenize=False)."""
        out: dict[int, Logprob] = {}
        for token_id, logprob, rank in zip(row.token_ids, row.logprobs, row.ranks):
            if token_id not in out:
                text = decode_token(self.tokenizer, token_id) if decode and self.tokenizer is not None else None
                out[token_id] = Logprob(logprob, rank, text)
        return out

    def _prompt_logprobs(self, parent: _ParentState, delta: bool) -> list | None:
        """The parent's prompt logprobs for this output: None until the first child has them all, and for a DELTA
        output after the one that carried them."""
        first = parent.children[0].request
        if first.prompt_logprobs is None or first.prompt_logprobs_pending or (delta and parent.prompt_logprobs_sent):
            return None
        if parent.prompt_logprobs is None:
            decode = parent.params.detokenize
            parent.prompt_logprobs = [None] + [self._logprob_dict(row, decode) for row in first.prompt_logprobs[1:]]
        parent.prompt_logprobs_sent = True
        return parent.prompt_logprobs

    def _make_output(self, parent: _ParentState, touched: list[_ChildState] | None = None) -> RequestOutput | None:
        """The parent's output; a DELTA one holds the children with something unsent, which are among `touched` (the
        children updated this step) when that is given."""
        finished = parent.finished()
        kind = parent.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        candidates = sorted(touched, key=lambda c: c.index) if delta and touched is not None else parent.children
        completions = [self._completion(c, delta, finished) for c in candidates
                       if not delta or c.sent_tokens < c.request.num_output_tokens
                       or (c.finish_reason and not c.finish_sent)]
        prompt_logprobs = self._prompt_logprobs(parent, delta)
        if finished:
            self.forget(parent.request_id)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions,
                             finished, num_cached_tokens=max(parent.children[0].request.num_cached_tokens, 0),
                             prompt_logprobs=prompt_logprobs)

    def _completion(self, c: _ChildState, delta: bool, finished: bool) -> CompletionOutput:
        tokens = c.request.output_token_ids
        start = c.sent_tokens if delta else 0
        c.sent_tokens = len(tokens)
        text = ""
        if c.detokenizer is not None:
            text = c.detokenizer.get_next_output_text(c.finish_reason is not None, delta)
        logprobs = c.logprobs[start:] if c.logprobs is not None else None
        c.finish_sent = c.finish_reason is not None
        return CompletionOutput(c.index, text, list(tokens[start:]), c.cumulative_logprob, logprobs,
                                c.finish_reason, c.stop_reason)

    def forget(self, parent_id: str) -> None:
        """Drop all state of a finished or aborted user request."""
        parent = self.parents.pop(parent_id, None)
        for child in parent.children if parent else []:
            self.child_to_parent.pop(child.request.request_id, None)
