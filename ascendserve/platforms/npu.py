"""Huawei Ascend NPUs through torch_npu (CANN); selected when torch_npu imports and sees a device."""

import torch

from ascendserve.platforms.interface import Platform


def _torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return None
    return getattr(torch, "npu", None)


def why_no_npu() -> str | None:
    """Why an installed torch_npu gives no NPU (it fails to import: CANN's libraries not found; or it sees no
    device); None when torch_npu is not installed or an NPU is there."""
    import importlib.util

    try:
        if importlib.util.find_spec("torch_npu") is None:
            return None
        import torch_npu  # noqa: F401
    except (ImportError, OSError, RuntimeError) as e:  # a missing libascendcl.so, a CANN / torch version mismatch
        return f"torch_npu is installed but does not import ({type(e).__name__}: {e}); is CANN's set_env.sh sourced?"
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return ("torch_npu is installed but sees no NPU (check npu-smi info, the container's --device mounts and "
                "ASCEND_RT_VISIBLE_DEVICES)")
    return None


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
