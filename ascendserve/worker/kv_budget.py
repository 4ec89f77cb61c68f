"""How many KV blocks to allocate, and a clear error when one max_model_len request cannot fit.

One budget covers both pools of a hybrid model: the state pool (max_num_seqs slots, one per
running request) is taken first, the KV blocks get the rest.
"""

import torch

from ascendserve.config import DEFAULT_MAX_NUM_SEQS, EngineArgs, EngineConfig
from ascendserve.logger import init_logger
from ascendserve.platforms.cpu import KV_CACHE_SPACE_ENV, kv_cache_space_bytes
from ascendserve.worker.model_runner import (is_hybrid, kv_cache_bytes_per_block, state_cache_bytes_per_slot,
                                             state_cache_spec)

logger = init_logger(__name__)

GiB = 1 << 30


class KVCacheTooSmallError(ValueError):
    """The KV pool cannot hold a single request of max_model_len tokens, or the state pool does not fit."""


def plan_kv_cache(config: EngineConfig, model: torch.nn.Module) -> int:
    """Blocks from num_gpu_blocks_override, else kv_cache_memory_bytes, else the platform default.

    Also settles `config.max_num_seqs` (one state slot per sequence on hybrid models).
    """
    args = config.args
    spec = model.kv_cache_spec()
    per_block = kv_cache_bytes_per_block(spec, args.block_size, config.kv_cache_dtype)
    state_spec = state_cache_spec(model, config) if is_hybrid(model) else {}
    per_slot = state_cache_bytes_per_slot(state_spec, config.dtype) if state_spec else 0
    budget, source = None, "num_gpu_blocks_override"
    on_cpu = config.platform.name == "cpu"
    if args.num_gpu_blocks_override is None:
        if args.kv_cache_memory_bytes is not None:
            budget, source = args.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        elif on_cpu and (space := kv_cache_space_bytes()) is not None:
            budget, source = space, KV_CACHE_SPACE_ENV
        else:
            if on_cpu and args.gpu_memory_utilization != EngineArgs.gpu_memory_utilization:
                logger.warning("gpu_memory_utilization=%s has no effect on the CPU: its KV cache takes a quarter of "
                               "the available memory, at most 4 GiB, unless %s (GiB, vLLM's) or "
                               "kv_cache_memory_bytes gives its size.", args.gpu_memory_utilization,
                               KV_CACHE_SPACE_ENV)
            # The default budget reads free memory now, after build_model: copies made at load
            # (MKL weight packs, layers/linear.py) are already resident and so already excluded.
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            budget = config.platform.default_kv_cache_bytes(args.gpu_memory_utilization, weight_bytes)
            source = f"{config.platform.name} default"
    config.max_num_seqs = _resolve_max_num_seqs(args.max_num_seqs, per_slot, budget)
    if args.max_num_seqs is None:  # the default never runs more sequences than a step has tokens for
        config.max_num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
    state_bytes = config.max_num_seqs * per_slot
    state_note = ""
    if state_bytes:
        state_note = (f"; state cache: {config.max_num_seqs} slots (max_num_seqs) x {per_slot} bytes = "
                      f"{_size(state_bytes)} (conv states in {state_spec.get('conv_dtype') or config.dtype}, "
                      f"recurrent states in {state_spec['ssm_dtype']})")
    if budget is None:
        num_blocks = args.num_gpu_blocks_override
    else:
        if state_bytes > budget:
            raise KVCacheTooSmallError(
                f"the state pool of {config.max_num_seqs} slots (max_num_seqs) x {per_slot} bytes needs "
                f"{_size(state_bytes)}, more than the whole cache budget of {_size(budget)} (from {source}); "
                f"lower max_num_seqs or give the cache more memory")
        num_blocks = max((budget - state_bytes) // per_block, 0)
        if state_bytes:
            source += " minus the state pool"
    if "default" not in source:  # a size the user gave (the defaults are shares of the free memory)
        _check_fits_in_memory(config.platform, num_blocks * per_block + state_bytes, source)
    if config.max_model_len_auto and 0 < num_blocks * args.block_size < config.max_model_len:
        logger.warning("max_model_len auto: %d tokens, what the KV cache holds (the model allows %d)",
                       num_blocks * args.block_size, config.max_model_len)
        config.max_model_len = num_blocks * args.block_size
        if not args.enable_chunked_prefill and args.max_num_batched_tokens is None:  # it was the model's length
            config.max_num_batched_tokens = config.max_model_len
    needed = -(-config.max_model_len // args.block_size)
    logger.info("KV cache (%s): %d blocks x %d tokens = %d tokens, %s (%s, %d layers); "
                "%.1f requests of max_model_len %d fit at once%s", source, num_blocks, args.block_size,
                num_blocks * args.block_size, _size(num_blocks * per_block), config.kv_cache_dtype,
                spec["num_layers"], num_blocks / needed, config.max_model_len, state_note)
    if num_blocks < needed:
        raise KVCacheTooSmallError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * args.block_size} tokens, "
            f"{num_blocks * per_block / GiB:.2f} GiB, from {source}) but one request of "
            f"max_model_len={config.max_model_len} needs {needed} blocks ({needed * per_block / GiB:.2f} GiB); "
            f"lower max_model_len or give the cache more memory (kv_cache_memory_bytes, "
            f"num_gpu_blocks_override or gpu_memory_utilization)" + (" or lower max_num_seqs" if state_bytes else ""))
    return num_blocks


def _check_fits_in_memory(platform, pool_bytes: int, source: str) -> None:
    """A size the user gave must fit in the memory free now (the weights already loaded): allocating more would be
    the kernel's OOM kill mid-start on a CPU, a CUDA OOM traceback on a GPU, instead of this line."""
    free, _ = platform.mem_get_info()
    if pool_bytes > free:
        raise ValueError(f"the KV cache asked for ({source}) takes {_size(pool_bytes)}, more than the {_size(free)} "
                         f"of {platform.name} memory free now, after the weights; give it less")


def _resolve_max_num_seqs(requested: int | None, per_slot: int, budget: int | None) -> int:
    """The user's max_num_seqs; by default 256, or for a hybrid model as many state slots as fit
    in half of the cache budget (so the KV blocks keep the other half), whichever is smaller."""
    if requested is not None:
        return requested
    if not per_slot or budget is None or DEFAULT_MAX_NUM_SEQS * per_slot <= budget // 2:
        return DEFAULT_MAX_NUM_SEQS
    fit = max(1, budget // 2 // per_slot)
    logger.info("max_num_seqs not set: using %d (not %d) so that the recurrent-state pool (%s per sequence) "
                "takes at most half of the %s cache budget; set --max-num-seqs to choose", fit,
                DEFAULT_MAX_NUM_SEQS, _size(per_slot), _size(budget))
    return fit


def _size(num_bytes: int) -> str:
    """GiB, or MiB below a tenth of a GiB, so small pools do not read as 0.00 GiB."""
    return f"{num_bytes / GiB:.2f} GiB" if num_bytes >= GiB // 10 else f"{num_bytes / (1 << 20):.2f} MiB"
