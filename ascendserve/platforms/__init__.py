"""Pick the platform: an explicit device string, else NPU, then CUDA, then CPU."""

import os

from ascendserve.logger import init_logger
from ascendserve.platforms.cpu import CpuPlatform
from ascendserve.platforms.cuda import CudaPlatform
from ascendserve.platforms.interface import Platform
from ascendserve.platforms.npu import NpuPlatform, why_no_npu

logger = init_logger(__name__)

_PLATFORMS = {"cpu": CpuPlatform, "cuda": CudaPlatform, "npu": NpuPlatform}
# Why an asked-for accelerator is absent when its stack is not even installed (why_no_npu / why_no_gpu say None then).
_NOT_INSTALLED = {"npu": "torch_npu is not installed (Ascend NPUs run through torch_npu and CANN)",
                  "cuda": "this torch is a CPU build"}


def why_no_gpu() -> str | None:
    """Why a CUDA build of torch gives no GPU; None for a CPU build or when a GPU is there."""
    import torch

    if torch.version.cuda is None or torch.cuda.is_available():
        return None
    return (f"torch {torch.__version__} is a CUDA build but sees no GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})")


def get_platform(device: str | None = None) -> Platform:
    """The platform for `device` ("cpu", "cuda", "npu", "auto"/None = the best available)."""
    if device in (None, "auto"):
        for cls in (NpuPlatform, CudaPlatform):
            platform = cls()
            if platform.is_available():
                return platform
        # An accelerator stack that is installed but gives no device is said once: a large model running on the CPU
        # instead, silently, looks like a hang.
        for why in (why_no_npu(), why_no_gpu()):
            if why:
                logger.warning("%s: running on the CPU (--device npu / cuda makes this an error).", why)
        return CpuPlatform()
    name = device.split(":")[0]
    if name not in _PLATFORMS:
        raise ValueError(f"device must be one of {sorted(_PLATFORMS)} or 'auto', got {device!r}")
    platform = _PLATFORMS[name]()
    if not platform.is_available():
        why = (why_no_npu() if name == "npu" else why_no_gpu()) or _NOT_INSTALLED[name]
        raise ValueError(f"device {device!r} was requested but is not available in this process: {why}")
    return platform


__all__ = ["Platform", "CpuPlatform", "CudaPlatform", "NpuPlatform", "get_platform"]
