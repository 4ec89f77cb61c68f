"""NVIDIA GPUs through torch.cuda."""

import torch

from ascendserve.platforms.interface import Platform


class CudaPlatform(Platform):
    """CUDA devices; KV pool sized by --gpu-memory-utilization of total device memory."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def default_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        if checkpoint_dtype in (None, torch.float32):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return checkpoint_dtype

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def synchronize(self) -> None:
        torch.cuda.synchronize()
