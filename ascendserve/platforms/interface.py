"""What the engine needs to know about a device family: names, dtypes, memory, backends."""

import torch


class Platform:
    """One device family. Subclasses override what differs; the engine asks, never assumes."""

    name = "base"
    device_type = "cpu"
    dist_backend = "gloo"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    # Whether the model's elementwise chains are torch.compiled unless --enforce-eager (compilation.py).
    compile_by_default = True

    def is_available(self) -> bool:
        """True when this platform's device can be used in this process."""
        raise NotImplementedError

    def device(self, index: int = 0) -> torch.device:
        """The torch device for local rank `index`."""
        return torch.device(self.device_type, index)

    def default_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype used for `--dtype auto` given the checkpoint's declared dtype."""
        return checkpoint_dtype or torch.float32

    def check_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype actually used for a requested one (may convert with a warning)."""
        if dtype not in self.supported_dtypes:
            raise ValueError(f"dtype {dtype} is not supported on {self.name}; "
                             f"use one of {[str(d) for d in self.supported_dtypes]}")
        return dtype

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        raise NotImplementedError

    def default_kv_cache_bytes(self, gpu_memory_utilization: float, weight_bytes: int) -> int:
        """Bytes for the KV (and state) pools when neither a block count nor a size is given."""
        free, total = self.mem_get_info()
        return int(total * gpu_memory_utilization) - (total - free)

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
