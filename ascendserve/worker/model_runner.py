"""Turns a SchedulerOutput into tensors, runs the model, samples one token per finishing request."""

from dataclasses import dataclass

import torch

from ascendserve.config import EngineConfig
from ascendserve.engine.scheduler import SchedulerOutput
from ascendserve.layers.attention import build_attention_metadata
from ascendserve.logger import init_logger
from ascendserve.worker.sampler import LogprobsRow, Sampler, SamplingRow

logger = init_logger(__name__)


@dataclass
class ModelRunnerOutput:
    """Sampled tokens (and logprobs rows) of the requests that reached their last known token."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, LogprobsRow]


class ModelRunner:
    """Owns the model, its KV cache tensors and the sampler on one device."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, num_blocks: int) -> None:
        self.config = config
        self.model = model
        self.device = config.device
        self.block_size = config.args.block_size
        self.sampler = Sampler(seed=config.args.seed)
        self.kv_caches = allocate_kv_caches(model.kv_cache_spec(), num_blocks, self.block_size,
                                            config.dtype, self.device)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One forward pass over every scheduled token, then sampling for the finishing rows."""
        if sched.is_empty():
            return ModelRunnerOutput({}, {})
        input_ids, positions, logits_rows, sampling = self._prepare_inputs(sched)
        meta = build_attention_metadata(
            [len(s.token_ids) for s in sched.scheduled], [s.start_pos for s in sched.scheduled],
            [s.block_ids for s in sched.scheduled], self.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not logits_rows:
            return ModelRunnerOutput({}, {})
        logits = self.model.compute_logits(hidden[logits_rows])
        out = self.sampler(logits, [row for _, row in sampling])
        ids = [req_id for req_id, _ in sampling]
        logprobs = {i: lp for i, lp in zip(ids, out.logprobs) if lp is not None}
        return ModelRunnerOutput(dict(zip(ids, out.sampled_token_ids)), logprobs)

    def _prepare_inputs(self, sched: SchedulerOutput):
        tokens, positions, logits_rows, sampling = [], [], [], []
        for s in sched.scheduled:
            tokens.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
            if s.sample:
                logits_rows.append(len(tokens) - 1)
                req = s.request
                sampling.append((s.request_id, SamplingRow(
                    req.sampling_params, req.prompt_token_ids, req.output_token_ids, req.eos_token_ids)))
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(tokens), as_tensor(positions), logits_rows, sampling


def kv_cache_bytes_per_block(spec: dict, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all attention layers (K and V)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * spec["num_layers"] * block_size * spec["num_kv_heads"] * spec["head_dim"] * elem


def allocate_kv_caches(spec: dict, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, kv_heads, head_dim] tensor per attention layer."""
    shape = (2, num_blocks, block_size, spec["num_kv_heads"], spec["head_dim"])
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec["num_layers"])]
