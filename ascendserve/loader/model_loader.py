"""From engine arguments to a resolved EngineConfig, a tokenizer and a model with its weights."""

import glob
import json
import os
import pickle

import torch
from safetensors import safe_open

from ascendserve.config import MAX_MODEL_LEN_AUTO, EngineArgs, EngineConfig
from ascendserve.layers.rotary import cover_positions, position_limit
from ascendserve.loader.resolve import PYTORCH_BIN_PATTERN, SAFETENSORS_PATTERN
from ascendserve.logger import init_logger
from ascendserve.models.registry import supported_architecture
from ascendserve.models.weights import WeightLoadError
from ascendserve.platforms import get_platform

logger = init_logger(__name__)

# vLLM's switch for a max_model_len above the model's max_position_embeddings.
ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"

_DTYPE_NAMES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "half": torch.float16}


def _is_gguf(path: str) -> bool:
    from ascendserve.loader.gguf_loader import is_gguf
    return is_gguf(path)


def resolve_model(args: EngineArgs) -> str:
    """Local path of the model: the demo GGUF when no model is given, else vLLM's resolution order."""
    if args.model is None:
        from ascendserve.loader.demo import get_demo_model_path
        return get_demo_model_path()
    from ascendserve.loader.resolve import resolve_model_path
    return resolve_model_path(args.model, revision=args.revision)


def load_hf_config(path: str, args: EngineArgs):
    """The transformers config of the (text) model at `path`."""
    if _is_gguf(path):
        from ascendserve.loader.gguf_loader import load_gguf_config
        config = load_gguf_config(path)
    else:
        from transformers import AutoConfig
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
        except ValueError as e:
            _explain_unknown_model_type(path, e)
            raise
    if callable(args.hf_overrides):  # vLLM's other form: a function of the config, returning it
        config = args.hf_overrides(config)
    else:
        apply_hf_overrides(config, args.hf_overrides or {})
    _refuse_quantized_checkpoint(config, path)
    return config


def _explain_unknown_model_type(path: str, error: ValueError) -> None:
    """transformers' 'does not recognize this architecture' (its advice: upgrade transformers) said in this engine's
    terms: a model this engine does not run is named with the architectures it does; only for one it runs is a newer
    transformers the fix. Returns (the caller re-raises) for any other error."""
    import transformers

    from ascendserve.models.registry import supported_architectures

    text = str(error)
    if "does not recognize this architecture" not in text and "Unrecognized model" not in text:
        return
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return
    model_type, architectures = raw.get("model_type"), raw.get("architectures")
    if set(architectures or []) & set(supported_architectures()):
        raise ValueError(f"the model at {path} is a {architectures[0]} (model_type {model_type!r}), which the "
                         f"installed transformers {transformers.__version__} cannot read: pip install -U "
                         f"'transformers>=5.2,<6'") from None
    what = f"model_type {model_type!r}" if model_type else "no model_type"
    raise ValueError(f"the model at {path} ({what}, architectures {architectures}) is not one this engine runs; "
                     f"supported architectures: {supported_architectures()}") from None


def _refuse_quantized_checkpoint(config, path: str) -> None:
    """A checkpoint whose config declares a quantization method (fp8, awq, gptq, compressed-tensors, vllm-ascend's
    w8a8...) stores integer or fp8 values with scales this engine does not read: a clear error before loading, not
    garbage outputs."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(
        quantization, "quant_method", None)
    raise ValueError(f"the checkpoint at {path} is quantized (quantization_config, quant_method={method!r}): "
                     f"quantized checkpoints are not supported; use the unquantized (bf16) checkpoint, or it with "
                     f"--quantization int8 / int4 (weight-only, quantized at load, CPU)")


def apply_hf_overrides(config, overrides: dict) -> None:
    """vLLM's hf_overrides: a dict for a nested config (Qwen3.5's text_config) updates it key by key, as the model
    card's YaRN recipe needs; rope_scaling / rope_parameters update the rope dict (rope_theta and the rest kept);
    anything else is set as given."""
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            apply_hf_overrides(current, value)
        elif key in ("rope_scaling", "rope_parameters") and isinstance(value, dict):
            config.rope_parameters = {**(getattr(config, "rope_parameters", None) or {}), **value}
        else:
            setattr(config, key, value)


def load_tokenizer(path: str, args: EngineArgs):
    """The tokenizer from `args.tokenizer`, else from the model (None with skip_tokenizer_init)."""
    if args.skip_tokenizer_init:
        return None
    source = args.tokenizer or path
    if args.tokenizer is not None and not os.path.exists(args.tokenizer):
        # a repo id: found in the HF (or ModelScope) cache, else its tokenizer files alone are fetched
        from ascendserve.loader.resolve import resolve_model_path
        source = resolve_model_path(args.tokenizer, revision=args.tokenizer_revision, tokenizer_only=True)
    if _is_gguf(source):
        from ascendserve.loader.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(source)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)


def eos_token_ids(path: str, tokenizer, hf_config) -> frozenset[int]:
    """Stop ids: generation_config.json's eos_token_id (int or list), else the tokenizer's eos."""
    ids: set[int] = set()
    gen_path = os.path.join(path, "generation_config.json") if os.path.isdir(path) else None
    if gen_path and os.path.exists(gen_path):
        with open(gen_path) as f:
            ids |= _as_id_set(json.load(f).get("eos_token_id"))
    if not ids:
        ids |= _as_id_set(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _as_id_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Resolve the model, read its config and settle dtype, lengths and caching."""
    platform = get_platform(args.device)
    _check_quantization_device(args, platform)
    path = resolve_model(args)
    hf_config = load_hf_config(path, args)
    supported_architecture(getattr(hf_config, "architectures", None))  # before the tokenizer loads: its error misleads
    text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
    dtype = _resolve_dtype(args.dtype, hf_config, text_config, platform)
    auto = args.max_model_len == MAX_MODEL_LEN_AUTO  # the model's length for now; plan_kv_cache fits it
    max_model_len = _resolve_max_model_len(None if auto else args.max_model_len, text_config)
    budget = args.max_num_batched_tokens or (2048 if args.enable_chunked_prefill else max_model_len)
    if not args.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({budget}) is smaller than max_model_len "
                         f"({max_model_len}) with chunked prefill disabled: a long prompt could never "
                         f"be scheduled; raise max_num_batched_tokens or enable chunked prefill")
    if args.max_num_seqs is not None and budget < args.max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({budget}) must be at least max_num_seqs ({args.max_num_seqs}): a "
                         f"decode step of every running sequence takes one token each; raise max_num_batched_tokens "
                         f"or lower max_num_seqs")
    names = args.served_model_name or args.model or _demo_name()
    served = names[0] if isinstance(names, list) else names
    kv_cache_dtype = dtype if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)
    conv_state_dtype, ssm_state_dtype = _resolve_state_dtypes(args, text_config, platform)
    return EngineConfig(args=args, model_path=path, hf_config=hf_config, dtype=dtype,
                        max_model_len=max_model_len, max_num_batched_tokens=budget,
                        enable_prefix_caching=_resolve_prefix_caching(args.enable_prefix_caching, text_config),
                        device=platform.device(), platform=platform, served_model_name=served,
                        kv_cache_dtype=kv_cache_dtype, conv_state_dtype=conv_state_dtype,
                        ssm_state_dtype=ssm_state_dtype, max_model_len_auto=auto)


def _check_quantization_device(args: EngineArgs, platform) -> None:
    """--quantization int8 / int4 is quantized at load onto the CPU kernels' layouts (layers/quantization.py): on
    another device it is an error before the model loads, not a failure inside its first forward."""
    if args.quantization and platform.name != "cpu":
        raise ValueError(f"quantization={args.quantization!r} (weight-only, quantized at load) runs on the CPU only; "
                         f"the device is {platform.name}: leave quantization unset there")


def _has_recurrent_layers(text_config) -> bool:
    """Whether the model has recurrent (Gated DeltaNet) layers, by its config's layer_types."""
    return "linear_attention" in (getattr(text_config, "layer_types", None) or ())


def _resolve_prefix_caching(requested: bool | None, text_config) -> bool:
    """On unless turned off, except for hybrid models (recurrent layers), where it is always off.

    A prefix hit on a hybrid model would need the recurrent state at the prefix boundary, which
    is not kept yet: reusing only the KV blocks would be silently wrong.
    """
    if not _has_recurrent_layers(text_config):
        return requested is not False
    if requested:
        logger.warning("enable_prefix_caching is ignored: this model has recurrent (Gated DeltaNet) layers, "
                       "and prefix caching for them needs recurrent-state checkpoints, which are not "
                       "implemented yet; running without prefix caching")
    elif requested is None:
        logger.info("Prefix caching is off: the model has recurrent (Gated DeltaNet) layers")
    return False


def _resolve_state_dtypes(args: EngineArgs, text_config, platform) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(conv, recurrent) state dtypes of a hybrid model, as vLLM settles them (None: the model's state_cache_spec
    decides; (None, None) for a model without recurrent layers).

    mamba_cache_dtype sets both; mamba_ssm_cache_dtype the recurrent state alone. With both auto the recurrent
    state takes the checkpoint's `mamba_ssm_dtype` (Qwen3.5 declares float32), else float32. On CPU the conv state
    stays float32 whatever is asked: the fused Gated DeltaNet ops (csrc/gdn_*_cpu.cpp) read it in fp32, and it is
    a few percent of a slot (Qwen3.5-0.8B: 72 KiB against the recurrent state's 1 MiB per layer).
    """
    if not _has_recurrent_layers(text_config):
        return None, None
    declared = getattr(text_config, "mamba_ssm_dtype", None)
    declared = _DTYPE_NAMES.get(declared, torch.float32) if isinstance(declared, str) else torch.float32
    conv = None if args.mamba_cache_dtype == "auto" else _DTYPE_NAMES[args.mamba_cache_dtype]
    ssm_name = args.mamba_ssm_cache_dtype if args.mamba_ssm_cache_dtype != "auto" else args.mamba_cache_dtype
    ssm = declared if ssm_name == "auto" else _DTYPE_NAMES[ssm_name]
    if ssm != declared:
        narrower = ssm.itemsize < declared.itemsize
        logger.warning("Recurrent (Gated DeltaNet) states in %s, not the checkpoint's %s (--mamba-ssm-cache-dtype / "
                       "--mamba-cache-dtype)%s", str(ssm).removeprefix("torch."), str(declared).removeprefix("torch."),
                       ": less state memory and traffic, not bit-exact" if narrower else "")
    if conv is not None and platform.name == "cpu" and conv != torch.float32:
        logger.info("Conv states stay float32 on CPU (the fused Gated DeltaNet ops read them in fp32); "
                    "mamba_cache_dtype %s applies to the recurrent states", args.mamba_cache_dtype)
        conv = torch.float32
    return conv, ssm


def _demo_name() -> str:
    from ascendserve.loader.demo import DEMO_MODEL
    return DEMO_MODEL


def _resolve_dtype(name: str, hf_config, text_config, platform) -> torch.dtype:
    """`dtype`, or with "auto" the checkpoint's: the root config's (where transformers 5 saves a composite model's),
    else the text config's (vLLM's order), as the platform runs it."""
    if name != "auto":
        return platform.check_dtype(_DTYPE_NAMES[name])
    declared = next((value for config in (hf_config, text_config) for key in ("dtype", "torch_dtype")
                     if (value := getattr(config, key, None))), None)
    if isinstance(declared, str):
        declared = _DTYPE_NAMES.get(declared)
    return platform.default_dtype(declared)


def _resolve_max_model_len(requested: int | None, text_config) -> int:
    """max_model_len, by default the model's own limit: its length field times the rope scaling factor (vLLM's rule:
    Qwen3.5 with YaRN factor 4 over 262144 allows 1048576)."""
    limit = position_limit(text_config)
    if requested is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        return limit
    if limit is not None and requested > limit:
        if os.environ.get(ALLOW_LONG_ENV, "").strip().lower() in ("1", "true"):
            logger.warning("max_model_len %d is larger than the model's maximum length (%d); used as asked (%s): "
                           "positions past %d may give wrong outputs", requested, limit, ALLOW_LONG_ENV, limit)
            return requested
        raise ValueError(f"max_model_len ({requested}) is larger than the model's maximum length ({limit}: "
                         f"max_position_embeddings, times the rope scaling factor if any); lower max_model_len, "
                         f"extend the context with rope scaling (--hf-overrides with rope_parameters, e.g. YaRN), or "
                         f"set {ALLOW_LONG_ENV}=1 to use it anyway (as vLLM; positions past {limit} may give wrong "
                         f"outputs)")
    return requested


def iter_safetensors(path: str):
    """(name, tensor) for every tensor of the checkpoint in the directory `path`: the safetensors files its
    model.safetensors.index.json names (another file beside them, a stale consolidated one say, is not read; a missing
    one is an error naming it), else every *.safetensors file; without any, pytorch *.bin files (vLLM's fallback)."""
    from safetensors import SafetensorError

    for file in _weight_files(path):
        try:
            if file.endswith(".bin"):
                tensors = torch.load(file, map_location="cpu", weights_only=True)
                yield from tensors.items()
                continue
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
            raise WeightLoadError(f"cannot read the weight file {file} ({e}): it is truncated or corrupt, an "
                                  f"interrupted download or copy most often; fetch it again") from None


def _weight_files(path: str) -> list[str]:
    for index_name, pattern in (("model.safetensors.index.json", SAFETENSORS_PATTERN),
                                ("pytorch_model.bin.index.json", PYTORCH_BIN_PATTERN)):
        files = sorted(glob.glob(os.path.join(path, pattern)))
        index = os.path.join(path, index_name)
        if files and os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                listed = sorted(set(json.load(f).get("weight_map", {}).values()))
            missing = [name for name in listed if not os.path.isfile(os.path.join(path, name))]
            if missing:
                raise FileNotFoundError(f"{index} lists weight files that are not in {path}: {missing}; the download "
                                        f"is incomplete")
            return [os.path.join(path, name) for name in listed]
        if files:
            return files
    raise FileNotFoundError(f"no *.safetensors (or pytorch *.bin) weight files in {path}")


def iter_weights(path: str):
    """Checkpoint tensors from a GGUF file or a directory of safetensors, with HF names."""
    if _is_gguf(path):
        from ascendserve.loader.gguf_loader import iter_gguf_weights
        return iter_gguf_weights(path)
    return iter_safetensors(path)


def build_model(config: EngineConfig) -> torch.nn.Module:
    """Instantiate the registered model class on the device and load the checkpoint into it."""
    from ascendserve.models.registry import get_model_class
    cls = get_model_class(getattr(config.hf_config, "architectures", None))
    with torch.device(config.device):
        default = torch.get_default_dtype()
        torch.set_default_dtype(config.dtype)
        try:
            model = cls(config.hf_config)
            cover_positions(model, config.max_model_len)  # a max_model_len past the model's own limit (allowed)
        finally:
            torch.set_default_dtype(default)
    model.load_weights(iter_weights(config.model_path))
    int8_activations = config.args.activation_quantization == "int8"
    if config.args.quantization:
        from ascendserve.layers.quantization import quantize_model_
        stats = quantize_model_(model, config.args.quantization, int8_activations=int8_activations)
    else:  # fp32 on CPU: MKL-packed weights for decode batches (a no-op elsewhere)
        from ascendserve.layers.prepack import prepack_linears_
        stats = prepack_linears_(model, int8_activations=int8_activations)
    if int8_activations and not stats.get("int8_activations"):
        logger.warning("--activation-quantization int8 has no effect: the model has no 4-bit-weight linears on "
                       "this device (a Q4_0 / Q4_1 GGUF, or --quantization int4, on a CPU where the kernels build) "
                       "and no --quantization int8 layers on an AVX512-VNNI CPU")
    if config.device.type == "cpu":
        from ascendserve.layers.prepack import compact_embeddings_
        compact_embeddings_(model)
        from ascendserve.layers import cpu_kernels
        cpu_kernels.ops()  # build or load the C++ kernels now, not inside the first request
    if not config.args.enforce_eager:
        from ascendserve.compilation import compile_model_
        compile_model_(model, config.platform)
    return model.eval()
