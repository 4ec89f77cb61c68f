"""Continuous batching: which requests run this step and how many tokens each (torch-free)."""

import time
from collections import deque
from dataclasses import dataclass, field

from ascendserve.engine.kv_cache_manager import KVCacheManager
from ascendserve.engine.request import Request, RequestStatus
from ascendserve.engine.state_cache_manager import StateCacheManager


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions start_pos, start_pos+1, ...

    With async scheduling the last token of a decode may not be known when the step is scheduled
    (the previous step is still sampling it): `token_ids` is then shorter than `num_tokens` until
    `SchedulerOutput.fill_placeholders()` copies it in.
    """

    request_id: str
    token_ids: list[int]
    num_tokens: int
    start_pos: int
    block_ids: list[int]
    state_slot: int | None
    sample: bool  # the step reaches the last known token, so one new token is sampled
    request: Request  # read-only for the runner: sampling params, prompt and output ids


@dataclass
class SchedulerOutput:
    """A plain description of one step; the model runner turns it into tensors."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # since the previous step

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed in this step, over all requests."""
        return sum(s.num_tokens for s in self.scheduled)

    def fill_placeholders(self) -> None:
        """Copy in the tokens that were still being sampled when this step was scheduled.

        A request that ended before its placeholder was sampled (stop token, abort) gets token 0:
        the step still runs it, and its result is discarded.
        """
        for s in self.scheduled:
            if len(s.token_ids) < s.num_tokens:
                known = s.request.all_token_ids[s.start_pos:s.start_pos + s.num_tokens]
                s.token_ids = known + [0] * (s.num_tokens - len(known))

    def is_empty(self) -> bool:
        """True when nothing is scheduled."""
        return not self.scheduled


@dataclass
class RequestUpdate:
    """What one step did to one request: new tokens and whether it finished."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    """First come, first served, with a token budget per step and recompute preemption.

    Each step, running requests go first (decodes and unfinished chunked prefills), each taking
    min(tokens not yet computed, budget left); when the KV pool is full the newest running request
    is preempted: its blocks and state slot are freed, `num_computed_tokens` goes back to 0 and it
    returns to the front of the waiting queue. Waiting requests are then admitted in order while
    the budget, `max_num_seqs`, blocks and state slots allow; the first that does not fit stops
    admission (no overtaking).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, enable_chunked_prefill: bool = True,
                 state_cache_manager: StateCacheManager | None = None) -> None:
        self.kv = kv_cache_manager
        self.state = state_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_step: list[str] = []
        self.num_preemptions = 0

    # -- queue management ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request at the back of the waiting queue."""
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """Finish (stop string, abort) requests wherever they are; unknown ids are ignored."""
        finished = []
        for request_id in ([request_ids] if isinstance(request_ids, str) else request_ids):
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        """Waiting plus running requests."""
        return len(self.waiting) + len(self.running)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating blocks and state slots."""
        out = SchedulerOutput(finished_request_ids=self._finished_since_step)
        self._finished_since_step = []
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted_request_ids:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not self._may_extend(request):
                i += 1
                continue
            num_new = min(request.num_tokens + request.num_output_placeholders - request.num_computed_tokens,
                          budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                self._add_scheduled(out, request, num_new)
                budget -= num_new
                i += 1
        return budget

    def _may_extend(self, request: Request) -> bool:
        """False when the tokens already being sampled will end the request by length (async only)."""
        pending = request.num_output_placeholders
        return not pending or (request.num_output_tokens + pending < request.max_tokens
                               and request.num_tokens + pending < self.max_model_len)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:  # preempted while its last step runs: wait for its token
                break
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if self.state is not None and self.state.allocate(request.request_id) is None:
                break
            if not self.kv.allocate_slots(request, num_new, hits):
                if self.state is not None:
                    self.state.free(request.request_id)
                break
            self.waiting.popleft()
            self.kv.record_lookup(request, num_hit_tokens)
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_scheduled(out, request, num_new)
            budget -= num_new

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        sample = start + num_new == request.num_tokens + request.num_output_placeholders
        out.scheduled.append(ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:start + num_new],
            num_tokens=num_new,
            start_pos=start,
            block_ids=self.kv.get_block_ids(request.request_id),
            state_slot=self.state.get_slot(request.request_id) if self.state else None,
            sample=sample,
            request=request,
        ))
        request.num_computed_tokens += num_new
        request.num_output_placeholders += sample

    def _preempt(self, request: Request) -> None:
        self._free_request(request, record=False)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _free_request(self, request: Request, record: bool = True) -> None:
        self.kv.free(request)
        if self.state is not None:
            self.state.free(request.request_id)
        if record:
            self._finished_since_step.append(request.request_id)
            del self.requests[request.request_id]

    # -- after the model ran -------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput,
                           sampled_token_ids: dict[str, int]) -> list[RequestUpdate]:
        """Append sampled tokens, finish requests on stop tokens and length.

        A request preempted while the step ran (async scheduling) still gets its token: it was
        computed from the request's own state, and the recompute starts from zero anyway.
        """
        updates = []
        for sched in out.scheduled:
            request = sched.request
            request.num_output_placeholders -= sched.sample
            if request.is_finished():  # aborted or stopped while the step ran
                continue
            token = sampled_token_ids.get(sched.request_id)
            if token is None:
                continue
            was_running = request.status == RequestStatus.RUNNING
            request.append_output_token(token)
            finished = self._check_stop(request, token)
            if finished:
                (self.running if was_running else self.waiting).remove(request)
                self._free_request(request)
            updates.append(RequestUpdate(request, [token], finished))
        return updates

    def _check_stop(self, request: Request, token: int) -> bool:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token in request.eos_token_ids and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and token in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return True
        if request.grammar is not None and request.grammar.ended:  # structured output complete
            request.status = RequestStatus.FINISHED_STOPPED
            request.finished_by_grammar = True
            return True
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
