"""Huawei Ascend NPUs through torch_npu (CANN); selected when torch_npu imports and sees a device."""

import torch

from ascendserve.platforms.interface import Platform


def _torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return None
    return getattr(torch, "npu", None)


class NpuPlatform(Platform):
    """Ascend NPUs: device 'npu', HCCL for collectives, bf16 by default (910B has no fast fp32)."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"

    def is_available(self) -> bool:
        npu = _torch_npu()
        return bool(npu is not None and npu.is_available())

    def default_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        if checkpoint_dtype in (None, torch.float32):
            return torch.bfloat16
        return checkpoint_dtype

    def mem_get_info(self) -> tuple[int, int]:
        return _torch_npu().mem_get_info()

    def synchronize(self) -> None:
        _torch_npu().synchronize()
