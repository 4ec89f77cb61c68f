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
        shards: dict[str, set[str]] = {}  # fused parameter -> the pieces loaded into it
        for name, tensor in weights:
            if name.endswith(skip) or name.startswith(ignore_prefixes):
                continue
            param_name, piece = self._load_one(name, tensor)
            loaded.add(param_name)
            if piece is not None:
                shards.setdefault(param_name, set()).add(piece)
        missing = sorted(set(self.params) - loaded)
        # a fused parameter with a piece missing (k_proj of q/k/v, say) would keep that piece's random rows
        missing += sorted(self._piece_name(param_name, piece) for param_name, got in shards.items()
                          for piece in self._pieces_of(param_name) - got)
        if missing:
            raise WeightLoadError(f"checkpoint has no tensor for {len(missing)} parameters, "
                                  f"e.g. {missing[:5]}")
        return loaded

    def _load_one(self, name: str, tensor: torch.Tensor) -> tuple[str, str | None]:
        """Copy one tensor; (the model parameter it went into, the packed piece it was, or None)."""
        for piece, (fused, shard) in self.packed.items():
            if f".{piece}." in name:
                fused_name = name.replace(f".{piece}.", f".{fused}.")
                param = self._param(fused_name, name)
                module = self.model.get_submodule(fused_name.rsplit(".", 2)[0])
                sizes = self.shard_sizes(fused, module)
                start = sum(sizes[:shard])
                _copy(param.data.narrow(0, start, sizes[shard]), tensor, name)
                return fused_name, piece
        _copy(self._param(name, name).data, tensor, name)
        return name, None

    def _pieces_of(self, param_name: str) -> set[str]:
        """The packed pieces a fused parameter is made of ("...qkv_proj.weight" -> {q_proj, k_proj, v_proj})."""
        return {piece for piece, (fused, _) in self.packed.items() if f".{fused}." in param_name}

    def _piece_name(self, param_name: str, piece: str) -> str:
        """The checkpoint name of one piece of a fused parameter."""
        fused = self.packed[piece][0]
        return param_name.replace(f".{fused}.", f".{piece}.")

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
