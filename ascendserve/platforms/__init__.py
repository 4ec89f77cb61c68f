"""Pick the platform: an explicit device string, else NPU, then CUDA, then CPU."""

from ascendserve.platforms.cpu import CpuPlatform
from ascendserve.platforms.cuda import CudaPlatform
from ascendserve.platforms.interface import Platform
from ascendserve.platforms.npu import NpuPlatform

_PLATFORMS = {"cpu": CpuPlatform, "cuda": CudaPlatform, "npu": NpuPlatform}


def get_platform(device: str | None = None) -> Platform:
    """The platform for `device` ("cpu", "cuda", "npu", "auto"/None = the best available)."""
    if device in (None, "auto"):
        for cls in (NpuPlatform, CudaPlatform):
            platform = cls()
            if platform.is_available():
                return platform
        return CpuPlatform()
    name = device.split(":")[0]
    if name not in _PLATFORMS:
        raise ValueError(f"device must be one of {sorted(_PLATFORMS)} or 'auto', got {device!r}")
    platform = _PLATFORMS[name]()
    if not platform.is_available():
        raise ValueError(f"device {device!r} was requested but is not available in this process")
    return platform


__all__ = ["Platform", "CpuPlatform", "CudaPlatform", "NpuPlatform", "get_platform"]
