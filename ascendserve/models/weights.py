"""Copy checkpoint tensors into a model, fusing q/k/v and gate/up shards along the output dim."""

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ascendserve.logger import init_logger

logger = init_logger(__name__)


class WeightLoadError(ValueError):
    """A checkpoint tensor does not fit the model (name or shape), or one is missing."""


class StackedLoader:
    """Loads HF-named tensors; `packed` maps e.g. "q_proj" -> ("qkv_proj", 0).

    `shard_sizes(fused_name, module)` gives the output rows of each shard, e.g. [q, kv, kv].
    """

    def __init__(self, model: nn.Module, packed: dict[str, tuple[str, int]],
                 shard_sizes: Callable[[str, nn.Module], list[int]]) -> None:
        self.model = model
        self.packed = packed
        self.shard_sizes = shard_sizes
        self.params = dict(model.named_parameters())

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], skip: tuple[str, ...] = (),
             ignore_prefixes: tuple[str, ...] = ()) -> set[str]:
        """Load everything; raise WeightLoadError on unknown names, bad shapes or missing params."""
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(skip) or name.startswith(ignore_prefixes):
                continue
            loaded.add(self._load_one(name, tensor))
        missing = sorted(set(self.params) - loaded)
        if missing:
            raise WeightLoadError(f"checkpoint has no tensor for {len(missing)} parameters, "
                                  f"e.g. {missing[:5]}")
        return loaded

    def _load_one(self, name: str, tensor: torch.Tensor) -> str:
        for piece, (fused, shard) in self.packed.items():
            if f".{piece}." in name:
                fused_name = name.replace(f".{piece}.", f".{fused}.")
                param = self._param(fused_name, name)
                module = self.model.get_submodule(fused_name.rsplit(".", 2)[0])
                sizes = self.shard_sizes(fused, module)
                start = sum(sizes[:shard])
                _copy(param.data.narrow(0, start, sizes[shard]), tensor, name)
                return fused_name
        _copy(self._param(name, name).data, tensor, name)
        return name

    def _param(self, name: str, ckpt_name: str) -> nn.Parameter:
        if name not in self.params:
            raise WeightLoadError(f"checkpoint tensor {ckpt_name!r} matches no model parameter")
        return self.params[name]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise WeightLoadError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, "
                              f"the model expects {tuple(dst.shape)}")
    if not src.is_floating_point() or src.element_size() == 1:  # int8 / uint8 / fp8 values are a quantized layout
        raise WeightLoadError(f"checkpoint tensor {name!r} is {src.dtype}: quantized checkpoints are not supported "
                              f"(their values mean nothing without their scales); use the unquantized (bf16) "
                              f"checkpoint, or --quantization int8 / int4 on a CPU")
    dst.copy_(src)
