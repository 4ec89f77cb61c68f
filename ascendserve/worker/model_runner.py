"""Turns a SchedulerOutput into tensors, runs the model, samples one token per finishing request."""

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch

from ascendserve.config import EngineConfig
from ascendserve.engine.scheduler import SchedulerOutput
from ascendserve.layers.attention import build_attention_metadata
from ascendserve.logger import init_logger
from ascendserve.platforms.cpu import advise_huge_pages
from ascendserve.worker.decode_graphs import DecodeGraphs, capture_sizes, decode_graphs_wanted
from ascendserve.worker.sampler import (LogprobsRow, Sampler, SamplingRow, plain_greedy_without_logprobs,
                                        token_logprobs)

logger = init_logger(__name__)

# Prompt logprobs take the logits of this many prompt positions at a time (Qwen3.5's 248k vocabulary: ~250 MB fp32)
PROMPT_LOGITS_ROWS = 256


@dataclass
class ModelRunnerOutput:
    """Sampled tokens (and logprobs rows) of the requests that reached their last known token."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, LogprobsRow]
    # request id -> (its first prompt entry computed this step, the rows of that entry and the next ones)
    prompt_logprobs: dict[str, tuple[int, list[LogprobsRow]]] = field(default_factory=dict)


@dataclass
class PreparedStep:
    """A step's inputs except the token ids, which async scheduling may only know at launch time."""

    sched: SchedulerOutput
    positions: torch.Tensor | None  # None, and the two metadata too, for a step a decode graph takes
    attn_meta: object  # AttentionMetadata
    state_meta: "StateMetadata | None"
    logits_rows: list[int]
    sampling: list[tuple[str, SamplingRow]]  # (request id, its sampling row) per row to sample
    graph_plan: tuple | None = None  # DecodeGraphs.plan's (context lengths, bucket) for a step a graph takes
    prompt_rows: list["PromptRows"] = field(default_factory=list)


@dataclass
class PromptRows:
    """The step's rows whose logits give one request's prompt logprobs: rows first_row.. predict prompt entries
    first_entry.. (the prompt tokens `token_ids`), with `num_top` top tokens each (-1: whole vocabulary)."""

    request_id: str
    first_entry: int
    first_row: int
    token_ids: list[int]
    num_top: int


@dataclass
class StateMetadata:
    """Which state slot each sequence reads and writes this step; built once, shared by all recurrent layers.

    Single-token steps that continue a state (start_pos > 0) are decodes and run the recurrent
    kernel; every other sequence (a prompt, a prefill chunk, a 1-token prompt) runs the chunked
    kernel, from its slot or from zeros when has_initial_state is False (start_pos == 0: a new or
    a preempted request, whose slot may hold another request's leftovers). Example: query_lens
    [1, 5, 3], start_positions [9, 0, 64], slots [2, 0, 1] -> decode rows [0], slots [2]; prefill
    rows [1..8], cu_seqlens [0, 5, 8], slots [0, 1], has_initial_state [False, True].
    """

    decode_token_idx: torch.Tensor | None = None  # [Bd] rows of the decodes; None if there are none
    decode_slots: torch.Tensor | None = None  # [Bd]
    # (first, order) when the decode slots are exactly first..first+Bd-1; order: rows by slot, or None
    decode_slot_block: tuple[int, torch.Tensor | None] | None = None
    prefill_token_idx: torch.Tensor | None = None  # [Tp] rows of the prefills; None if they are all rows, in order
    # Bd when a mixed step's decodes are its first Bd rows and its prefills all the rest (the scheduler's usual
    # order): the layers then take both kinds as row slices, views, not gathered copies (Qwen3.5, 2048 prefill rows:
    # aten::index copied the 8192-wide projection in 24-29 ms per layer, 18 layers a mixed step); else None
    split_row: int | None = None
    prefill_cu_seqlens: torch.Tensor | None = None  # [Bp + 1] over the prefill rows; None if no prefill
    prefill_slots: torch.Tensor | None = None  # [Bp]
    prefill_has_initial_state: torch.Tensor | None = None  # [Bp] bool


def build_state_metadata(query_lens: list[int], start_positions: list[int], slots: list[int],
                         device: torch.device) -> StateMetadata:
    """Split the step's sequences into decodes and prefills for the recurrent layers."""
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    decode_rows, decode_slots, prefill_rows, prefill = [], [], [], []
    row = 0
    for q_len, start, slot in zip(query_lens, start_positions, slots):
        if q_len == 1 and start > 0:
            decode_rows.append(row)
            decode_slots.append(slot)
        else:
            prefill_rows.extend(range(row, row + q_len))
            prefill.append((q_len, slot, start > 0))
        row += q_len
    meta = StateMetadata()  # every field None until set below
    if decode_rows:
        meta.decode_token_idx, meta.decode_slots = as_long(decode_rows), as_long(decode_slots)
        first = min(decode_slots)
        if max(decode_slots) - first == len(decode_slots) - 1:  # distinct slots: a contiguous block
            order = sorted(range(len(decode_slots)), key=decode_slots.__getitem__)
            meta.decode_slot_block = (first, None if order == list(range(len(order))) else as_long(order))
    if prefill:
        lens, prefill_slots, has_initial = zip(*prefill)
        meta.prefill_token_idx = as_long(prefill_rows) if decode_rows else None
        if decode_rows and decode_rows[-1] == len(decode_rows) - 1:  # decodes first (rows ascend)
            meta.split_row = len(decode_rows)
        meta.prefill_cu_seqlens = as_long([0, *accumulate(lens)])
        meta.prefill_slots = as_long(prefill_slots)
        meta.prefill_has_initial_state = torch.tensor(has_initial, dtype=torch.bool, device=device)
    return meta


class ModelRunner:
    """Owns the model, its KV cache tensors (and state pools of a hybrid model) and the sampler on one device."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, num_blocks: int) -> None:
        self.config = config
        self.model = model
        self.device = config.device
        self.block_size = config.args.block_size
        self.num_blocks = num_blocks
        self.sampler = Sampler(seed=config.args.seed)
        # Decode graphs write their padding rows to one KV block and one state slot past the managed ones (scratch).
        graphs = decode_graphs_wanted(config) and _graph_safe(model)
        scratch = 1 if graphs else 0
        self.kv_caches = allocate_kv_caches(model.kv_cache_spec(), num_blocks + scratch, self.block_size,
                                            config.kv_cache_dtype, self.device)
        # Hybrid models (Gated DeltaNet): one state slot per running request, max_num_seqs slots.
        self.num_state_slots = config.max_num_seqs if is_hybrid(model) else 0
        self.state_caches = None
        if self.num_state_slots:
            self.state_caches = allocate_state_caches(state_cache_spec(model, config), self.num_state_slots + scratch,
                                                      config.dtype, self.device)
        self.decode_graphs = None
        if graphs:
            sizes = capture_sizes(config.max_num_seqs, config.args.compilation_config.get("cudagraph_capture_sizes"))
            self.decode_graphs = DecodeGraphs(self, sizes, config.max_model_len, scratch_block=num_blocks,
                                              scratch_state_slot=self.num_state_slots if self.num_state_slots else None)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One forward pass over every scheduled token, then sampling for the finishing rows."""
        if sched.is_empty():
            return ModelRunnerOutput({}, {})
        return self.execute(self.prepare(sched))

    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """Positions, attention and state metadata, and sampling rows of a non-empty step.

        Reads only what the scheduler fixed (lengths, positions, blocks, slots), so it can run while
        the previous step is still computing; the token ids are read by `execute`. A pure decode step
        that a decode graph takes gets no positions or metadata: the graph's static buffers hold them.
        """
        query_lens = np.fromiter((s.num_tokens for s in sched.scheduled), dtype=np.int64)
        graph_plan = self.decode_graphs.plan(sched) if self.decode_graphs is not None else None
        positions = meta = state_meta = None
        if graph_plan is None:
            starts = np.fromiter((s.start_pos for s in sched.scheduled), dtype=np.int64)
            flat = np.concatenate([np.arange(s.start_pos, s.start_pos + s.num_tokens) for s in sched.scheduled])
            meta = build_attention_metadata(query_lens, starts, flat, [s.block_ids for s in sched.scheduled],
                                            self.block_size, self.device)
            if self.state_caches is not None:
                state_meta = build_state_metadata(query_lens.tolist(), starts.tolist(),
                                                  [s.state_slot for s in sched.scheduled], self.device)
            positions = torch.from_numpy(flat).to(self.device)
        ends = np.cumsum(query_lens) - 1
        logits_rows, sampling, prompt_rows = [], [], []
        for s, end in zip(sched.scheduled, ends.tolist()):
            req = s.request
            if req.prompt_logprobs is not None:
                # position p's logits predict prompt entry p + 1; skip the entries already computed
                lo = max(s.start_pos, req.num_prompt_logprobs)
                hi = min(s.start_pos + s.num_tokens, req.num_prompt_tokens - 1)
                if lo < hi:
                    first_row = end + 1 - s.num_tokens + lo - s.start_pos
                    prompt_rows.append(PromptRows(s.request_id, lo + 1, first_row, req.prompt_token_ids[lo + 1:hi + 1],
                                                  req.sampling_params.prompt_logprobs))
            if s.sample:
                logits_rows.append(end)
                sampling.append((s.request_id, SamplingRow(
                    req.sampling_params, req.prompt_token_ids, req.output_token_ids, req.eos_token_ids, req.grammar)))
        return PreparedStep(sched, positions, meta, state_meta, logits_rows, sampling, graph_plan, prompt_rows)

    @torch.inference_mode()
    def execute(self, step: PreparedStep) -> ModelRunnerOutput:
        """Run a prepared step: the forward pass over its token ids, then sampling."""
        tokens = [t for s in step.sched.scheduled for t in s.token_ids]
        if step.graph_plan is not None:
            hidden = self.decode_graphs.run(step.sched, tokens, step.graph_plan)
        else:  # not a pure decode step a graph takes (or no graphs): the model, eagerly
            input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            if self.state_caches is None:
                hidden = self.model(input_ids, step.positions, self.kv_caches, step.attn_meta)
            else:
                hidden = self.model(input_ids, step.positions, self.kv_caches, step.attn_meta,
                                    self.state_caches, step.state_meta)
        prompt_logprobs = {p.request_id: (p.first_entry, self._prompt_logprobs(hidden, p)) for p in step.prompt_rows}
        if not step.logits_rows:
            return ModelRunnerOutput({}, {}, prompt_logprobs)
        hidden, rows = hidden[step.logits_rows], [row for _, row in step.sampling]
        ids = [req_id for req_id, _ in step.sampling]
        if (tokens := self._fused_greedy(hidden, rows)) is not None:
            return ModelRunnerOutput(dict(zip(ids, tokens.tolist())), {}, prompt_logprobs)
        logits = self.model.compute_logits(hidden)
        out = self.sampler(logits, rows)
        logprobs = {i: lp for i, lp in zip(ids, out.logprobs) if lp is not None}
        return ModelRunnerOutput(dict(zip(ids, out.sampled_token_ids)), logprobs, prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, p: PromptRows) -> list[LogprobsRow]:
        """One request's prompt logprobs of this step, from the logits of PROMPT_LOGITS_ROWS positions at a time."""
        out = []
        for lo in range(0, len(p.token_ids), PROMPT_LOGITS_ROWS):
            targets = p.token_ids[lo:lo + PROMPT_LOGITS_ROWS]
            rows = hidden[p.first_row + lo:p.first_row + lo + len(targets)]
            logprobs = self.model.compute_logits(rows).float().log_softmax(dim=-1)
            out += token_logprobs(logprobs, targets, [p.num_top] * len(targets))
        return out

    def _fused_greedy(self, hidden: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
        """The rows' greedy tokens from the lm_head's fused argmax (Bf16Linear.argmax), where the model's logits are its
        lm_head's outputs (`greedy_from_lm_head`) and every row only takes their argmax; else None (the logits are
        made and sampled). The same tokens as the sampler's argmax_rows over those logits."""
        if not getattr(self.model, "greedy_from_lm_head", False) or not plain_greedy_without_logprobs(rows):
            return None
        argmax = getattr(self.model.lm_head, "argmax", None)
        return argmax(hidden) if argmax is not None else None


def kv_cache_bytes_per_block(spec: dict, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all attention layers (K and V)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * spec["num_layers"] * block_size * spec["num_kv_heads"] * spec["head_dim"] * elem


def allocate_kv_caches(spec: dict, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, kv_heads, head_dim] tensor per attention layer."""
    shape = (2, num_blocks, block_size, spec["num_kv_heads"], spec["head_dim"])
    return [_zeros_on_huge_pages(shape, dtype, device) for _ in range(spec["num_layers"])]


def _zeros_on_huge_pages(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on a Linux CPU the memory is first advised to transparent huge pages (before it is
    touched: pages already faulted in stay 4 KiB). Decode attention reads each request's blocks from
    anywhere in the cache, a TLB miss per 4 KiB page: 30 demo layers at 64 requests x 320 tokens on
    random blocks took 93.0 ms with 4 KiB pages and 83.3 ms with 2 MiB ones (74.0 / 69.1 on blocks in
    order; THP "madvise" mode, this machine's default)."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu" and tensor.numel():
        advise_huge_pages(tensor)
    return tensor.zero_()


def _graph_safe(model: torch.nn.Module) -> bool:
    """Whether a decode step of the model can be captured: its forward reads nothing back to the host (MoE routing
    does: `decode_graph_safe = False`); one line says so where graphs were asked for."""
    if getattr(model, "decode_graph_safe", True):
        return True
    logger.warning("%s reads values back to the host in its forward (expert routing): decode steps run eagerly "
                   "despite cudagraph_mode", type(model).__name__)
    return False


def is_hybrid(model: torch.nn.Module) -> bool:
    """True for models with recurrent layers that need a state slot per running request."""
    return hasattr(model, "state_cache_spec")


def state_cache_spec(model: torch.nn.Module, config: EngineConfig) -> dict:
    """The hybrid model's state_cache_spec with the state dtypes the engine settled (--mamba-cache-dtype,
    --mamba-ssm-cache-dtype: config.conv_state_dtype / ssm_state_dtype) where it set them."""
    spec = dict(model.state_cache_spec())
    if config.conv_state_dtype is not None:
        spec["conv_dtype"] = config.conv_state_dtype
    if config.ssm_state_dtype is not None:
        spec["ssm_dtype"] = config.ssm_state_dtype
    return spec


def state_cache_bytes_per_slot(spec: dict, dtype: torch.dtype) -> int:
    """Bytes one state slot takes over all recurrent layers (conv state in the spec's conv_dtype, else `dtype`;
    recurrent state in its ssm_dtype)."""
    conv_dtype = spec.get("conv_dtype") or dtype
    conv = torch.Size(spec["conv_shape"]).numel() * torch.tensor([], dtype=conv_dtype).element_size()
    ssm = torch.Size(spec["ssm_shape"]).numel() * torch.tensor([], dtype=spec["ssm_dtype"]).element_size()
    return spec["num_layers"] * (conv + ssm)


def allocate_state_caches(spec: dict, num_slots: int, dtype: torch.dtype,
                          device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(conv [num_slots, C, K-1] in the spec's conv_dtype (else `dtype`), recurrent [num_slots, Hv, dk, dv] in its
    ssm_dtype) zeroed, per recurrent layer."""
    return [(_zeros_on_huge_pages((num_slots, *spec["conv_shape"]), spec.get("conv_dtype") or dtype, device),
             _zeros_on_huge_pages((num_slots, *spec["ssm_shape"]), spec["ssm_dtype"], device))
            for _ in range(spec["num_layers"])]
