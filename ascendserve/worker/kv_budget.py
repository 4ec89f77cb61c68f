"""How many KV blocks to allocate, and a clear error when one max_model_len request cannot fit."""

import torch

from ascendserve.config import EngineConfig
from ascendserve.logger import init_logger
from ascendserve.worker.model_runner import kv_cache_bytes_per_block

logger = init_logger(__name__)

GiB = 1 << 30


class KVCacheTooSmallError(ValueError):
    """The KV pool cannot hold a single request of max_model_len tokens."""


def plan_kv_cache(config: EngineConfig, model: torch.nn.Module) -> int:
    """Blocks from num_gpu_blocks_override, else kv_cache_memory_bytes, else the platform default."""
    args = config.args
    spec = model.kv_cache_spec()
    per_block = kv_cache_bytes_per_block(spec, args.block_size, config.dtype)
    if args.num_gpu_blocks_override is not None:
        num_blocks, source = args.num_gpu_blocks_override, "num_gpu_blocks_override"
    else:
        if args.kv_cache_memory_bytes is not None:
            budget, source = args.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        else:
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            budget = config.platform.default_kv_cache_bytes(args.gpu_memory_utilization, weight_bytes)
            source = f"{config.platform.name} default"
        num_blocks = max(budget // per_block, 0)
    needed = -(-config.max_model_len // args.block_size)
    logger.info("KV cache (%s): %d blocks x %d tokens = %d tokens, %.2f GiB (%s, %d layers); "
                "%.1f requests of max_model_len %d fit at once", source, num_blocks, args.block_size,
                num_blocks * args.block_size, num_blocks * per_block / GiB, config.dtype,
                spec["num_layers"], num_blocks / needed, config.max_model_len)
    if num_blocks < needed:
        raise KVCacheTooSmallError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * args.block_size} tokens, "
            f"{num_blocks * per_block / GiB:.2f} GiB, from {source}) but one request of "
            f"max_model_len={config.max_model_len} needs {needed} blocks ({needed * per_block / GiB:.2f} GiB); "
            f"lower max_model_len or give the cache more memory (kv_cache_memory_bytes, "
            f"num_gpu_blocks_override or gpu_memory_utilization)")
    return num_blocks
