"""vLLM's engine flags on an argparse parser, and back to EngineArgs."""

import argparse
import json

from ascendserve.config import (ACTIVATION_QUANTIZATION_METHODS, ARRIVAL_WINDOW_CAP, KV_CACHE_DTYPES,
                                MAMBA_CACHE_DTYPES, MAX_MODEL_LEN_AUTO, QUANTIZATION_METHODS, EngineArgs,
                                check_parallelism)


# What building an engine raises for a wrong model, flag or file (not found, bad config, truncated weights, a KV cache
# that does not fit, a failed download): the commands print it as one error line, exit 2; anything else is a bug and
# keeps its traceback.
STARTUP_ERRORS = (ValueError, OSError)


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer is needed, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def non_negative_int(value: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer is needed, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {number}")
    return number


def positive_float(value: str) -> float:
    """argparse type: a number > 0 (inf allowed)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number is needed, got {value!r}") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {value}")
    return number


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_readable_int(value: str) -> int:
    """argparse type: an integer, or one with vLLM's suffix (decimal k / m / g, binary K / M / G): 32k -> 32000,
    32K -> 32768, 1.5k -> 1500."""
    text = value.strip()
    try:
        if text and text[-1] in _SUFFIXES:
            number = float(text[:-1]) * _SUFFIXES[text[-1]]
            if number != int(number):
                raise ValueError
            return int(number)
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer is needed (or one with k / m / g, K / M / G), got {value!r}") \
            from None


def max_model_len_flag(value: str) -> int:
    """argparse type of --max-model-len: human_readable_int, or vLLM's `auto` / -1 (the longest context the KV cache
    holds)."""
    if value.strip().lower() in ("auto", "-1"):
        return MAX_MODEL_LEN_AUTO
    return human_readable_int(value)


def json_object(value: str) -> dict:
    """argparse type: a JSON object."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {e}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {value!r}")
    return parsed


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that map one to one onto EngineArgs fields (`--max-model-len` -> max_model_len)."""
    d = EngineArgs()
    parser.add_argument("--tokenizer", default=None, help="tokenizer path or repo id (default: the model's)")
    parser.add_argument("--tokenizer-revision", default=None, help="revision of a --tokenizer repo id")
    parser.add_argument("--skip-tokenizer-init", action="store_true",
                        help="load no tokenizer: prompts must be token ids, outputs are token ids")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let transformers run a checkpoint's own config / tokenizer code")
    parser.add_argument("--revision", default=None, help="branch, tag or commit of a model repo id")
    parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                        help="weights and activations; auto: the checkpoint's, except that a 16-bit one runs in "
                             "float32 on a CPU without fast bf16 (AMX, or Zen 4/5 AVX512-BF16) and a float32 one in "
                             "bfloat16 on a GPU / NPU")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the sampling generator")
    parser.add_argument("--generation-config", default=d.generation_config,
                        help="default sampling parameters: auto (the checkpoint's generation_config.json), vllm "
                             "(none), or a directory holding a generation_config.json")
    parser.add_argument("--override-generation-config", type=json_object, default=None,
                        help='generation config keys on top of --generation-config, e.g. \'{"temperature": 0.5}\'')
    parser.add_argument("--max-model-len", type=max_model_len_flag, default=None,
                        help="e.g. 32768, 32k (32000) or 32K (32768), as vLLM reads it; auto (or -1): the longest "
                             "context the KV cache holds, at most the model's")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="most sequences running at once (default 256; fewer for a hybrid model when its "
                             "recurrent states would take more than half the cache)")
    parser.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None,
                        help="e.g. 8192 or 8K, as vLLM reads it")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="split long prompts into --max-num-batched-tokens chunks, mixed with decodes")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse the KV blocks of a shared prompt prefix (default on; off for hybrid models)")
    parser.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                        help="share of GPU / NPU memory for weights and caches; no effect on a CPU (see "
                             "VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="the number of KV cache blocks, whatever the memory")
    parser.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None,
                        help="e.g. 4G (4 GiB) or 4g (4 GB), as vLLM reads it")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no torch.compile and no CUDA graphs: every step runs eagerly")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                        help="schedule and prepare step N+1 while step N computes")
    parser.add_argument("--arrival-window-ms", type=float, default=d.arrival_window_ms,
                        help="when the engine is idle and a request arrives, wait until no other request has "
                             f"arrived for this many ms (at most {ARRIVAL_WINDOW_CAP} times as long) before the "
                             "first step, so requests sent together are prefilled together; 0 turns it off")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                        help="1: the model runs on one device (parallelism is not implemented yet)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="1, as --tensor-parallel-size")
    parser.add_argument("--device", default=d.device,
                        help="auto (an NPU, else a GPU, else the CPU), npu, cuda or cpu")
    parser.add_argument("--quantization", "-q", default=None,
                        help=f"weight-only quantization applied at load, one of {list(QUANTIZATION_METHODS)} "
                             f"(not bit-exact)")
    parser.add_argument("--activation-quantization", default=None, choices=list(ACTIVATION_QUANTIZATION_METHODS),
                        help="int8: layers with 4-bit weights (a Q4_0 / Q4_1 GGUF, --quantization int4), and "
                             "--quantization int8's on an AVX512-VNNI CPU, round their input to int8 per 32 values "
                             "and multiply with integer instructions, as llama.cpp does: prefill and batches "
                             "(2+ rows; int8's 16+) faster on a CPU; not bit-exact")
    parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                        help=f"one of {list(KV_CACHE_DTYPES)}; auto: the model dtype. bfloat16 under a float32 model "
                             f"(the CPU default) stores K/V in half the memory (twice the cached tokens) and halves "
                             f"what decode attention reads; attention still computes in float32; not bit-exact")
    parser.add_argument("--mamba-cache-dtype", default=d.mamba_cache_dtype,
                        help=f"one of {list(MAMBA_CACHE_DTYPES)}: dtype of a hybrid model's conv and recurrent (Gated "
                             "DeltaNet) states; auto: conv in the model dtype (float32 on CPU, whatever is asked), "
                             "recurrent as --mamba-ssm-cache-dtype")
    parser.add_argument("--mamba-ssm-cache-dtype", default=d.mamba_ssm_cache_dtype,
                        help=f"one of {list(MAMBA_CACHE_DTYPES)}: dtype of the recurrent states alone; auto: "
                             "--mamba-cache-dtype, else the checkpoint's mamba_ssm_dtype (Qwen3.5: float32). bfloat16 "
                             "halves the state pool and what each decode step moves (computed in float32 either way; "
                             "not bit-exact)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags (fields not on the namespace keep their defaults)."""
    check_parallelism(ns.tensor_parallel_size, ns.pipeline_parallel_size)  # before a warning about any other flag
    names = set(EngineArgs.field_names())
    kwargs = {k: v for k, v in vars(ns).items() if k in names and k != "model"}
    args = EngineArgs(model=getattr(ns, "model", None), **kwargs)
    args.validate()
    return args
