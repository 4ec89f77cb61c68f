"""Read llama.cpp GGUF files: HF config, tokenizer and float32 weights under HF parameter names.

Supported architectures: `llama`, `qwen2`, `qwen3` (dense). Weights are dequantized on the host with
`gguf.quants.dequantize`, one tensor at a time, so peak memory is one float32 tensor beyond the file's
memory map.
"""

import hashlib
import math
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from ascendserve.loader.gguf_file import GGUFFile, GGUFFormatError
from ascendserve.logger import init_logger

logger = init_logger(__name__)

_GGUF_MAGIC = b"GGUF"
_Q = gguf.GGMLQuantizationType
# Q5_0/Q5_1 are here because llama.cpp falls back to them in Q4_K_M/Q5_K_M files for tensors whose
# row length is not a multiple of 256 (e.g. Qwen2.5-0.5B's ffn_down).
SUPPORTED_GGML_TYPES = frozenset({
    _Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
})

# general.architecture -> (HF architectures entry, config class)
_ARCHITECTURES: dict[str, tuple[str, type[PretrainedConfig]]] = {
    "llama": ("LlamaForCausalLM", LlamaConfig),
    "qwen2": ("Qwen2ForCausalLM", Qwen2Config),
    "qwen3": ("Qwen3ForCausalLM", Qwen3Config),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors that carry no HF parameter: llama3 rope factors live in the config (see _rope_parameters).
_SKIPPED = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class UnsupportedGGUFError(ValueError):
    """The GGUF file uses an architecture, tensor or quantization type this loader cannot read."""


def is_gguf(path: str | os.PathLike) -> bool:
    """Return True when `path` is a regular file starting with the GGUF magic bytes."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == _GGUF_MAGIC


def _check_gguf(path: str) -> None:
    if not is_gguf(path):
        raise UnsupportedGGUFError(f"{path} is not a GGUF file (missing, or wrong magic bytes)")


def _open(path: str) -> GGUFFile:
    """The file's header and tensor table (gguf_file.py: 0.16 s for the demo, where gguf.GGUFReader took 4.7)."""
    _check_gguf(path)
    try:
        reader = GGUFFile(path)
    except GGUFFormatError as e:
        raise UnsupportedGGUFError(str(e)) from None
    splits = reader.get("split.count")
    if splits and splits > 1:  # llama.cpp's split files: each holds a part of the tensors
        raise UnsupportedGGUFError(f"{path} is one of {splits} split GGUF files, which are not supported; merge them "
                                   f"into one with `llama-gguf-split --merge {path} merged.gguf` and load that")
    return reader


def _architecture(reader: GGUFFile, path: str) -> str:
    arch = reader.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedGGUFError(f"{path}: GGUF architecture {arch!r} is not supported; "
                                   f"supported: {sorted(_ARCHITECTURES)}")
    return arch


# ---------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------

def load_gguf_config(path: str) -> PretrainedConfig:
    """Build the HF config (LlamaConfig / Qwen2Config / Qwen3Config) from a GGUF file's metadata."""
    reader = _open(path)
    arch = _architecture(reader, path)
    arch_name, config_cls = _ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}
    kwargs = _config_kwargs(reader, arch, tensors)
    kwargs["rope_parameters"] = _rope_parameters(reader, arch, tensors, kwargs["head_dim"])
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    return config_cls(architectures=[arch_name], dtype=_config_dtype(reader), **kwargs)


def _required(reader: GGUFFile, key: str) -> int:
    """An integer metadata value the model cannot be built without; UnsupportedGGUFError naming it when absent."""
    value = reader.get(key)
    if value is None:
        raise UnsupportedGGUFError(f"{reader.path}: the GGUF metadata has no {key!r}, which the model's shape needs "
                                   f"(llama.cpp's convert_hf_to_gguf.py writes it)")
    return int(value)


def _config_kwargs(reader: GGUFFile, arch: str, tensors: dict) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return reader.get(f"{arch}.{key}", default)

    hidden = _required(reader, f"{arch}.embedding_length")
    heads = _required(reader, f"{arch}.attention.head_count")
    # The embedding's row count is the vocab size (GGUF shape is (hidden, vocab)); it can exceed
    # the tokenizer's token count when the checkpoint pads the vocabulary.
    embed = tensors.get("token_embd.weight")
    vocab = int(embed.shape[-1]) if embed is not None else get("vocab_size")
    if not vocab:
        vocab = len(reader.get("tokenizer.ggml.tokens", []))
    kwargs = {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": _required(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _required(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        # llama.cpp drops output.weight when the HF checkpoint ties it to the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    for key, gguf_key in (("bos_token_id", "bos"), ("eos_token_id", "eos"),
                          ("pad_token_id", "padding")):
        value = reader.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if value is not None:
            kwargs[key] = int(value)
    return kwargs


def _rope_parameters(reader: GGUFFile, arch: str, tensors: dict,
                     head_dim: int) -> dict[str, Any]:
    theta = float(reader.get(f"{arch}.rope.freq_base", 10000.0))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = reader.get(f"{arch}.rope.scaling.type")
    factor = reader.get(f"{arch}.rope.scaling.factor") or reader.get(f"{arch}.rope.scale_linear")
    if scaling in ("linear", "yarn") or (scaling is None and factor):
        if not factor:
            raise UnsupportedGGUFError(f"rope scaling type {scaling!r} is set without a factor")
        params.update(rope_type=scaling or "linear", factor=float(factor))
        original = reader.get(f"{arch}.rope.scaling.original_context_length")
        if scaling == "yarn" and original:
            params["original_max_position_embeddings"] = int(original)
    elif scaling not in (None, "none"):
        raise UnsupportedGGUFError(f"rope scaling type {scaling!r} is not supported")
    if "rope_freqs.weight" in tensors:
        rope_dim = int(reader.get(f"{arch}.rope.dimension_count", head_dim))
        params.update(_llama3_rope(_dequantize(tensors["rope_freqs.weight"]), theta, rope_dim))
    return params


def _llama3_rope(freq_factors: np.ndarray, theta: float, rope_dim: int) -> dict[str, Any]:
    """Recover HF's llama3 rope parameters from llama.cpp's precomputed `rope_freqs` divisors.

    llama.cpp stores only the per-frequency divisors, e.g. [1, 1, ..., 2.6, ..., 8, 8]; Llama 3.x
    always used low_freq_factor=1, high_freq_factor=4 and an 8192 original context, with
    factor = the largest divisor. We recompute the divisors from those values and refuse on mismatch.
    """
    params = {"rope_type": "llama3", "factor": float(freq_factors.max()), "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    expected = _llama3_divisors(theta, rope_dim, params)
    if expected.shape != freq_factors.shape or not np.allclose(expected, freq_factors, rtol=1e-3):
        raise UnsupportedGGUFError(
            "rope_freqs.weight does not match Llama 3 rope scaling with "
            f"factor={params['factor']}, low_freq_factor=1, high_freq_factor=4, "
            "original_max_position_embeddings=8192; cannot express it as an HF rope config")
    return params


def _llama3_divisors(theta: float, rope_dim: int, p: dict[str, Any]) -> np.ndarray:
    # Same formula as llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors).
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / p["low_freq_factor"], old_ctx / p["high_freq_factor"]
    out = []
    for i in range(0, rope_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / rope_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(p["factor"])
        else:
            smooth = (old_ctx / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"])
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.asarray(out, dtype=np.float32)


def _config_dtype(reader: GGUFFile) -> torch.dtype:
    # The precision of the unquantized source: F32 files compute in float32, BF16 in bfloat16; F16
    # and quantized files in float16 (llama.cpp's scales are float16). Platforms may override.
    file_type = reader.get("general.file_type")
    if file_type == gguf.LlamaFileType.ALL_F32:
        return torch.float32
    if file_type == gguf.LlamaFileType.MOSTLY_BF16:
        return torch.bfloat16
    return torch.float16


# ---------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------

TOKENIZER_CACHE_ENV_VAR = "ASCENDSERVE_GGUF_TOKENIZER_CACHE"  # a directory; 0: no cache


def load_gguf_tokenizer(path: str, **kwargs: Any):
    """Build a transformers fast tokenizer (with the file's chat template) from GGUF metadata.

    transformers converts a GGUF's vocabulary in pure Python (12.6 s for the demo), so the result is saved
    once under the tokenizer cache (tokenizer_cache_dir) and later loads read it back (well under a second).
    """
    from transformers import AutoTokenizer

    _check_gguf(path)
    path = os.path.abspath(path)
    cached = tokenizer_cache_dir(path) if not kwargs else None
    tokenizer = None
    if cached is not None and os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        try:
            tokenizer = AutoTokenizer.from_pretrained(cached)
        except Exception as e:  # a damaged cache entry: convert from the GGUF again, and save that instead
            logger.warning("Cached tokenizer %s unreadable (%s); converting %s again", cached, e, path)
            shutil.rmtree(cached, ignore_errors=True)
    if tokenizer is None:
        if _open(path).get("tokenizer.ggml.model") is None:
            raise UnsupportedGGUFError(f"{path} holds no tokenizer (no tokenizer.ggml.* metadata): pass the original "
                                       f"model's tokenizer with --tokenizer (a directory or repo id), or "
                                       f"--skip-tokenizer-init to send token ids")
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  **kwargs)
    if getattr(tokenizer, "chat_template", None) is None:
        template = _open(path).get("tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template
    if cached is not None and not os.path.isdir(cached):
        _save_tokenizer(tokenizer, cached)
    return tokenizer


def tokenizer_cache_dir(path: str) -> str | None:
    """Where the tokenizer built from the GGUF at `path` is kept: $ASCENDSERVE_GGUF_TOKENIZER_CACHE (0: none),
    else <ascendserve cache>/gguf-tokenizers; one directory per file version and transformers version."""
    import transformers

    from ascendserve.loader.demo import default_cache_dir
    root = os.environ.get(TOKENIZER_CACHE_ENV_VAR) or str(default_cache_dir() / "gguf-tokenizers")
    if root == "0":
        return None
    stat = os.stat(path)
    key = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return os.path.join(os.path.expanduser(root), hashlib.sha256(key.encode()).hexdigest()[:24])


def _save_tokenizer(tokenizer, directory: str) -> None:
    """save_pretrained into a temporary directory renamed into place; a failure costs only the cache."""
    tmp = f"{directory}.tmp{os.getpid()}"
    try:
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, directory)
    except OSError as e:  # read-only cache, or another process saved it first
        logger.debug("GGUF tokenizer not cached in %s: %s", directory, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------

def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, float32 tensor in HF shape) for every weight in a GGUF file.

    `lm_head.weight` is yielded only when the file has `output.weight` (untied embeddings).
    """
    reader = _open(path)
    arch = _architecture(reader, path)
    heads = _required(reader, f"{arch}.attention.head_count")
    kv_heads = int(reader.get(f"{arch}.attention.head_count_kv", heads))
    logger.info("Loading %d GGUF tensors (%s) from %s", len(reader.tensors), arch, path)
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED:
            continue
        name = gguf_to_hf_name(tensor.name)
        array = _dequantize(tensor)
        if arch == "llama":
            array = _unpermute_qk(name, array, heads, kv_heads)
        yield name, torch.from_numpy(array)


def gguf_to_hf_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name (`blk.3.attn_q.weight`) to its HF name (`model.layers.3....`)."""
    match = _BLOCK_RE.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise UnsupportedGGUFError(f"GGUF tensor {gguf_name!r} has no known HF parameter name")


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    qtype = _Q(tensor.tensor_type)
    if qtype not in SUPPORTED_GGML_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_GGML_TYPES))
        raise UnsupportedGGUFError(f"GGUF tensor {tensor.name!r} has type {qtype.name}, "
                                   f"which is not supported (supported: {supported})")
    # GGUF lists dims fastest-first (ggml's ne order); numpy/torch want them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    array = gguf.quants.dequantize(tensor.data, qtype).reshape(shape)
    if array.dtype != np.float32 or not array.flags.writeable:
        array = array.astype(np.float32)  # F32 comes back as a read-only view of the memory map
    return array


def _unpermute_qk(name: str, array: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rotate-half -> interleaved pairs) for `llama` files.

    convert_hf_to_gguf.py stores w.reshape(n, 2, d // n // 2, *rest).swapaxes(1, 2); e.g. for one
    head of 4 rows, HF rows [0, 1, 2, 3] are stored as [0, 2, 1, 3]. We apply the inverse.
    """
    if ".self_attn.q_proj." in name:
        n = heads
    elif ".self_attn.k_proj." in name:
        n = kv_heads
    else:
        return array
    rows, rest = array.shape[0], array.shape[1:]
    if rows % (2 * n):
        raise UnsupportedGGUFError(f"{name}: {rows} rows cannot be split into {n} heads of rotary pairs")
    return np.ascontiguousarray(
        array.reshape(n, rows // n // 2, 2, *rest).swapaxes(1, 2).reshape(array.shape))
