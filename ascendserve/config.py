"""Engine configuration: vLLM's engine-argument names, validated once, then read everywhere."""

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from ascendserve.logger import init_logger

logger = init_logger(__name__)

DEFAULT_MAX_NUM_SEQS = 256


def env_switch(name: str) -> bool | None:
    """An on/off environment switch: True for 1/true/on/yes, False for 0/false/off/no, None if unset or else."""
    value = os.environ.get(name, "").strip().lower()
    return True if value in ("1", "true", "on", "yes") else False if value in ("0", "false", "off", "no") else None

_DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")
MAX_MODEL_LEN_AUTO = -1  # vLLM's max_model_len "auto" (or -1): the longest context the KV cache holds
QUANTIZATION_METHODS = ("int8", "int4")  # weight-only, applied after loading (layers/quantization.py)
# vLLM's (and vllm-ascend's) names of quantized-checkpoint formats, none of which loads here: `serve` accepts them with
# a warning (the weights load as stored), the offline API refuses them; any other name is a typo, refused everywhere.
CHECKPOINT_QUANTIZATION_METHODS = (
    "ascend", "awq", "awq_marlin", "cpu_awq", "gptq", "gptq_marlin", "gptq_marlin_24", "gptq_bitblas", "marlin", "fp8",
    "ptpc_fp8", "fbgemm_fp8", "fp_quant", "mxfp4", "mxfp8", "modelopt", "modelopt_fp4", "petit_nvfp4",
    "compressed-tensors", "compressed_tensors", "bitsandbytes", "bitblas", "gguf", "hqq", "aqlm", "qqq", "deepspeedfp",
    "tpu_int8", "experts_int8", "moe_wna16", "ipex", "inc", "quark", "torchao", "auto-round", "rtn", "neuron_quant")
# "auto": the model dtype; a half-precision cache under an fp32 model stores K/V rounded to 16 bits and is
# read back widened (attention itself stays fp32; not bit-exact)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
# A hybrid model's state pools (vLLM's --mamba-cache-dtype / --mamba-ssm-cache-dtype values)
MAMBA_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
ARRIVAL_WINDOW_CAP = 10  # the first step after idle waits at most this many arrival windows
MAX_ARRIVAL_WINDOW_MS = 1000
ACTIVATION_QUANTIZATION_METHODS = ("int8",)  # 4-bit-weight linears' activations (layers/compact_linear.py, Q4Panels)


@dataclass
class EngineArgs:
    """The arguments of `LLM(...)` and of `ascendserve serve`, with vLLM's names and defaults."""

    model: str | None = None  # None: the embedded demo model
    tokenizer: str | None = None  # a path or repo id (default: the model's)
    tokenizer_revision: str | None = None  # of a --tokenizer repo id (default: --revision)
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    dtype: str = "auto"
    seed: int | None = 0
    max_logprobs: int = 20  # most logprobs a request may ask for per token (vLLM's default); -1: no cap
    # Default sampling parameters: "auto" reads the checkpoint's generation_config.json, "vllm" none, a directory its
    # generation_config.json; override_generation_config's keys go on top (vLLM's flags)
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: 256, fewer for hybrid models if their state pool needs it
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool | None = None  # None: on, except where the model cannot support it
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = False
    async_scheduling: bool = False  # schedule step N+1 while step N runs (same tokens as the synchronous loop)
    # Served engine (AsyncLLM), from idle: the first step waits until no request has arrived for this long (at
    # most ARRIVAL_WINDOW_CAP times it), so requests sent together are prefilled in one step; 0 turns it off
    arrival_window_ms: float = 2.0
    tensor_parallel_size: int = 1
    device: str = "auto"
    served_model_name: str | list[str] | None = None
    hf_overrides: dict[str, Any] | None = None
    quantization: str | None = None  # None, "int8" or "int4": weight-only, quantized at load (not bit-exact)
    # None or "int8": 4-bit-weight linears (a Q4_0 / Q4_1 GGUF's, --quantization int4's), and --quantization int8's
    # on AVX512-VNNI, round their input to int8 per 32 values and multiply with integer instructions (CPU; not
    # bit-exact)
    activation_quantization: str | None = None
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # Recurrent-state dtypes of a hybrid model, one of MAMBA_CACHE_DTYPES each. mamba_cache_dtype: conv and recurrent
    # states (auto: conv in the model dtype, fp32 on CPU); mamba_ssm_cache_dtype: the recurrent state alone (auto:
    # mamba_cache_dtype, else the checkpoint's mamba_ssm_dtype, else float32). bf16 halves what decode moves; not
    # bit-exact.
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    # vLLM's compilation config; read: cudagraph_mode (FULL_DECODE_ONLY, FULL or FULL_AND_PIECEWISE capture pure decode
    # steps as CUDA graphs: worker/decode_graphs.py; unset or NONE: eager) and cudagraph_capture_sizes
    compilation_config: dict[str, Any] | None = None

    @classmethod
    def field_names(cls) -> list[str]:
        """Every accepted argument name."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "EngineArgs":
        """Build from keyword arguments (`LLM(...)`'s): vLLM's arguments this engine has no use for are accepted with
        one warning each (INERT_ENGINE_ARGS), strings for booleans and numbers are read as vLLM's config parsing
        reads them, a torch.dtype as its name, an int compilation_config as vLLM's level; any other unknown name
        raises TypeError listing the valid ones."""
        for name in [n for n in kwargs if n in INERT_ENGINE_ARGS]:
            value = kwargs.pop(name)
            if name == "hf_token" and value:
                os.environ["HF_TOKEN"] = value  # huggingface_hub's downloads read it
            elif name == "pipeline_parallel_size":
                check_parallelism(1, 1 if value is None else value)
            elif value not in INERT_ENGINE_ARGS[name][1]:
                logger.warning("%s=%r is accepted but has no effect: %s.", name, value, INERT_ENGINE_ARGS[name][0])
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise TypeError(f"unexpected engine argument(s) {unknown}; valid arguments are: "
                            f"{', '.join(cls.field_names())}")
        if "dtype" in kwargs and not isinstance(kwargs["dtype"], str):  # torch.bfloat16 -> "bfloat16"
            kwargs["dtype"] = str(kwargs["dtype"]).removeprefix("torch.")
        if kwargs.get("max_model_len") == "auto":
            kwargs["max_model_len"] = MAX_MODEL_LEN_AUTO
        if isinstance(kwargs.get("compilation_config"), int) and not isinstance(kwargs["compilation_config"], bool):
            kwargs["compilation_config"] = {"level": kwargs["compilation_config"]}
        kwargs = {name: _coerce(name, value, _FIELD_TYPES.get(name)) for name, value in kwargs.items()}
        args = cls(model=model, **kwargs)
        args.validate()
        return args

    def validate(self) -> None:
        """Raise ValueError naming the argument and its allowed range for a bad value."""
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")
        _check_quantization(self.quantization)
        if self.activation_quantization not in (None, *ACTIVATION_QUANTIZATION_METHODS):
            raise ValueError(f"activation_quantization must be one of {[None, *ACTIVATION_QUANTIZATION_METHODS]}, "
                             f"got {self.activation_quantization!r}")
        _check_kv_cache_dtype(self.kv_cache_dtype)
        for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            if getattr(self, name) not in MAMBA_CACHE_DTYPES:
                raise ValueError(f"{name} must be one of {list(MAMBA_CACHE_DTYPES)}, got {getattr(self, name)!r}")
        _check_positive("max_num_seqs", self.max_num_seqs)
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1 (-1: no cap), got {self.max_logprobs!r}")
        _check_positive("block_size", self.block_size)
        if self.max_model_len != MAX_MODEL_LEN_AUTO:
            _check_positive("max_model_len", self.max_model_len)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive("num_gpu_blocks_override", self.num_gpu_blocks_override)
        _check_positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if not 0 <= self.arrival_window_ms <= MAX_ARRIVAL_WINDOW_MS:
            raise ValueError(f"arrival_window_ms must be in [0, {MAX_ARRIVAL_WINDOW_MS}], got {self.arrival_window_ms}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check_compilation_config(self.compilation_config)
        check_parallelism(self.tensor_parallel_size)


def check_parallelism(tensor_parallel_size, pipeline_parallel_size=1) -> None:
    """Both sizes must be 1: the model runs on one device (ValueError naming the size asked for). Splitting a model
    that does not fit one device is what they are for, so asking for one is an error, not an inert flag."""
    for kind, size in (("tensor", tensor_parallel_size), ("pipeline", pipeline_parallel_size)):
        if size != 1:
            raise ValueError(f"{kind}_parallel_size must be 1 for now ({kind} parallelism is not implemented yet; "
                             f"the model runs on one device), got {size}")


# vLLM's LLM(...) arguments that change nothing here: name -> (why, values that need no warning)
INERT_ENGINE_ARGS = {
    "swap_space": ("preemption recomputes; nothing is swapped to host memory", (None, 0)),
    "cpu_offload_gb": ("no weights are offloaded", (None, 0)),
    "disable_log_stats": ("the offline engine logs no periodic stats", (None, True, False)),
    "tokenizer_mode": ("the Hugging Face tokenizer is used", (None, "auto")),
    "load_format": ("safetensors (or .bin, or GGUF) weights are read as found", (None, "auto")),
    "download_dir": ("downloads go to the Hugging Face cache (HF_HOME / HF_HUB_CACHE)", (None,)),
    "hf_token": ("", ()),  # sets HF_TOKEN
    "enable_lora": ("LoRA adapters are not implemented", (None, False)),
    "max_lora_rank": ("LoRA adapters are not implemented", (None,)),
    "max_loras": ("LoRA adapters are not implemented", (None,)),
    "pipeline_parallel_size": ("", (None, 1)),  # any other size is an error (check_parallelism)
    "data_parallel_size": ("data parallelism is not implemented", (None, 1)),
    "distributed_executor_backend": ("one process runs the model", (None,)),
    "limit_mm_per_prompt": ("multimodal input is not implemented", (None,)),
    "mm_processor_kwargs": ("multimodal input is not implemented", (None,)),
    "calculate_kv_scales": ("fp8 KV caches are not implemented", (None, False)),
    "enable_sleep_mode": ("sleep mode is not implemented", (None, False)),
    "speculative_config": ("speculative decoding (MTP) is not implemented", (None,)),
    "max_seq_len_to_capture": ("decode graphs cover max_model_len", (None,)),
    "disable_custom_all_reduce": ("there is no all-reduce", (None, True, False)),
    "scheduling_policy": ("requests run first come, first served", (None, "fcfs")),
    "worker_cls": ("one built-in worker", (None, "auto")),
    "use_v2_block_manager": ("one KV block manager", (None, True, False)),
}


def _field_types() -> dict[str, str]:
    """Each EngineArgs field's annotation as text ("bool", "int | None", ...)."""
    return {f.name: f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            for f in dataclasses.fields(EngineArgs)}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(name: str, value, annotation: str | None):
    """A string for a bool / int / float argument read as vLLM's config parsing reads it ("no" -> False, "0.5" ->
    0.5); anything else as given. A string that is none of those raises ValueError naming the argument."""
    if not isinstance(value, str) or annotation is None:
        return value
    kinds = {part.strip() for part in annotation.split("|")}
    if "str" in kinds or "Any" in kinds or "dict[str, Any]" in kinds:
        return value
    text = value.strip().lower()
    if "bool" in kinds and text in _TRUE + _FALSE:
        return text in _TRUE
    for kind, convert in (("int", int), ("float", float)):
        if kind in kinds:
            try:
                return convert(value)
            except ValueError:
                pass
    if kinds & {"bool", "int", "float"}:
        raise ValueError(f"{name} must be {' or '.join(sorted(kinds & {'bool', 'int', 'float'}))}, got {value!r}")
    return value


def _check_quantization(value: str | None) -> None:
    if value is None or value in QUANTIZATION_METHODS:
        return
    allowed = [None, *QUANTIZATION_METHODS]
    if value in CHECKPOINT_QUANTIZATION_METHODS:
        raise ValueError(f"quantization {value!r} is not supported: quantized checkpoints (fp8, awq, gptq, "
                         f"...) cannot be loaded; quantization must be one of {allowed} (weight-only, "
                         f"applied to a full-precision checkpoint at load)")
    raise ValueError(f"quantization must be one of {allowed} (weight-only, applied at load), got {value!r}, which "
                     f"is no quantization method vLLM knows either")


def _check_kv_cache_dtype(value) -> None:
    if value in KV_CACHE_DTYPES:
        return
    if isinstance(value, str) and value.startswith("fp8"):
        raise ValueError(f"kv_cache_dtype {value!r} is not supported: fp8 KV caches are not implemented; "
                         f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}")
    raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {value!r}")


CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def _check_compilation_config(value) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(f"compilation_config must be a JSON object such as "
                         f"{{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}}, got {value!r}")
    mode = value.get("cudagraph_mode", "NONE")
    if not isinstance(mode, str) or mode.upper() not in CUDAGRAPH_MODES:
        raise ValueError(f"compilation_config cudagraph_mode must be one of {list(CUDAGRAPH_MODES)}, got {mode!r}")
    sizes = value.get("cudagraph_capture_sizes")
    if sizes is not None and (not isinstance(sizes, list) or not sizes
                              or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)):
        raise ValueError(f"compilation_config cudagraph_capture_sizes must be a list of positive batch sizes, "
                         f"got {sizes!r}")
    ignored = sorted(set(value) - {"cudagraph_mode", "cudagraph_capture_sizes"})
    if ignored:
        logger.warning("compilation_config keys %s are accepted but have no effect: only cudagraph_mode and "
                       "cudagraph_capture_sizes are read (what torch.compile covers is fixed: compilation.py)", ignored)


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class EngineConfig:
    """The resolved configuration the engine runs with (after looking at the checkpoint)."""

    args: EngineArgs
    model_path: str  # local directory or .gguf file
    hf_config: Any  # transformers PretrainedConfig of the text model
    dtype: Any  # torch.dtype
    max_model_len: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    device: Any = None  # torch.device
    platform: Any = None
    served_model_name: str = ""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # resolved when the cache is planned
    # max_model_len "auto" (vLLM's, or -1): the model's length until the KV cache is planned, then as much as it holds
    max_model_len_auto: bool = False
    kv_cache_dtype: Any = None  # torch.dtype of the KV cache: `dtype` unless args.kv_cache_dtype says otherwise
    # torch.dtypes a hybrid model's state pools take over its state_cache_spec's (None: the spec's own)
    conv_state_dtype: Any = None
    ssm_state_dtype: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


_FIELD_TYPES = _field_types()
