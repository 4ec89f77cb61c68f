"""`ascendserve serve [MODEL]`: the OpenAI-compatible server, with `vllm serve`'s flags.

Every flag of a vLLM command line is accepted. Flags this engine implements act as in vLLM; flags with
no effect here (parallelism it does not have, graph capture, multimodal limits) are parsed, checked
(JSON values included) and reported with one warning line each, never silently ignored.
"""

import argparse
import json
import os
import sys
import threading

from ascendserve.cli.engine_flags import STARTUP_ERRORS, add_engine_flags, engine_args_from
from ascendserve.config import CHECKPOINT_QUANTIZATION_METHODS, QUANTIZATION_METHODS, check_parallelism
from ascendserve.logger import init_logger

logger = init_logger(__name__)

DEFAULT_HTTP_KEEP_ALIVE_S = 5.0  # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE default (and uvicorn's)

# JSON-valued flags (inert ones included: this table makes a flag JSON-valued) and a correct example of each, shown
# when a value does not parse.
JSON_FLAG_EXAMPLES = {
    "--compilation-config": '\'{"cudagraph_mode":"FULL_DECODE_ONLY"}\'',
    "--additional-config": '\'{"enable_cpu_binding":true}\'',
    "--limit-mm-per-prompt": '\'{"image":2,"video":0}\'',
    "--hf-overrides": '\'{"max_position_embeddings":32768}\'',
    "--speculative-config": '\'{"method":"mtp","num_speculative_tokens":1}\'',
    "--default-chat-template-kwargs": '\'{"enable_thinking":false}\'',
    "--pooler-config": '\'{"pooling_type":"LAST"}\'',
    "--eplb-config": '\'{"window_size":1000}\'',
    "--kv-transfer-config": '\'{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}\'',
    "--kv-events-config": '\'{"enable_kv_cache_events":true}\'',
    "--model-loader-extra-config": '\'{"enable_multithread_load":true}\'',
}

# Flags accepted for compatibility that change nothing in this engine: (argparse kwargs, why).
NO_EFFECT_FLAGS = {
    "--data-parallel-size": ({"type": int}, "data parallelism is not implemented; one engine replica serves"),
    "--data-parallel-size-local": ({"type": int}, "data parallelism is not implemented"),
    "--data-parallel-address": ({}, "data parallelism is not implemented"),
    "--data-parallel-rpc-port": ({"type": int}, "data parallelism is not implemented"),
    "--data-parallel-start-rank": ({"type": int}, "data parallelism is not implemented"),
    "--api-server-count": ({"type": int}, "one API server process serves"),
    "--headless": ({"action": "store_true"}, "there are no remote engines to run headless"),
    "--enable-expert-parallel": ({"action": "store_true"}, "expert parallelism is not implemented"),
    "--additional-config": ({}, "no platform plugin reads it"),
    "--speculative-config": ({}, "speculative decoding (MTP) is not implemented"),
    "--mamba-cache-mode": ({}, "the recurrent-state cache has one mode"),
    "--allowed-local-media-path": ({}, "multimodal input is not implemented"),
    "--limit-mm-per-prompt": ({}, "multimodal input is not implemented"),
    "--skip-mm-profiling": ({"action": "store_true"}, "multimodal input is not implemented"),
    "--language-model-only": ({"action": "store_true"}, "only the language model is loaded anyway"),
    "--mm-processor-cache-gb": ({"type": float}, "multimodal input is not implemented"),
    "--mm-encoder-tp-mode": ({}, "multimodal input is not implemented"),
    "--mm-processor-kwargs": ({}, "multimodal input is not implemented"),
    "--media-io-kwargs": ({}, "multimodal input is not implemented"),
    "--mm-processor-cache-type": ({}, "multimodal input is not implemented"),
    "--mm-shm-cache-max-object-size-mb": ({"type": int}, "multimodal input is not implemented"),
    "--mm-encoder-attn-backend": ({}, "multimodal input is not implemented"),
    "--interleave-mm-strings": ({"action": "store_true"}, "multimodal input is not implemented"),
    "--video-pruning-rate": ({"type": float}, "multimodal input is not implemented"),
    "--allowed-media-domains": ({"nargs": "+"}, "multimodal input is not implemented"),
    "--enable-mm-embeds": ({"action": "store_true"}, "multimodal input is not implemented"),
    "--worker-use-ray": ({"action": "store_true"}, "no Ray executor: one process runs the model"),
    "--distributed-executor-backend": ({}, "no distributed executor: one process runs the model"),
    "--attention-backend": ({}, "one attention implementation per platform"),
    "--structured-outputs-config": ({}, "structured outputs run on llguidance (vLLM's guidance backend) whichever "
                                        "backend is named, after the reasoning where a reasoning parser runs"),
    "--guided-decoding-backend": ({}, "structured outputs run on llguidance (vLLM's guidance backend)"),
    "--chat-template-content-format": ({"choices": ["auto", "string", "openai"]},
                                       "text content parts are joined into one string for the template (vLLM's "
                                       "'string' format)"),
    "--enable-prompt-tokens-details": ({"action": "store_true"}, "usage carries no prompt_tokens_details"),
    "--return-tokens-as-token-ids": ({"action": "store_true"}, "logprobs name tokens by their text"),
    "--response-role": ({}, "replies carry the role 'assistant'"),
    "--tool-parser-plugin": ({}, "parser plugins are not loaded; the built-in tool-call parsers are hermes, "
                                 "qwen3_coder and qwen3_xml"),
    "--tokenizer-mode": ({}, "the Hugging Face tokenizer is used"),
    "--load-format": ({}, "safetensors (or .bin, or GGUF) weights are read as found"),
    "--download-dir": ({}, "downloads go to the Hugging Face cache (HF_HOME / HF_HUB_CACHE)"),
    "--code-revision": ({}, "no remote code is run for the supported models"),
    "--config-format": ({}, "the Hugging Face config.json (or the GGUF's metadata) is read"),
    "--model-impl": ({}, "this engine's own model implementations run"),
    "--hf-config-path": ({}, "the config is read from the model's directory"),
    "--disable-frontend-multiprocessing": ({"action": "store_true"}, "the API server and the engine share one "
                                                                     "process already"),
    "--show-hidden-metrics-for-version": ({}, "no metric is hidden"),
    "--enable-log-outputs": ({"action": "store_true"}, "responses are not logged, only requests "
                                                       "(--enable-log-requests)"),
    "--otlp-traces-endpoint": ({}, "OpenTelemetry tracing is not implemented"),
    "--collect-detailed-traces": ({}, "OpenTelemetry tracing is not implemented"),
    # the rest of vLLM's engine flags: parallelism, memory and scheduler tunables with one setting here
    "--decode-context-parallel-size": ({"type": int}, "context parallelism is not implemented"),
    "--prefill-context-parallel-size": ({"type": int}, "context parallelism is not implemented"),
    "--data-parallel-backend": ({}, "data parallelism is not implemented"),
    "--data-parallel-hybrid-lb": ({"action": "store_true"}, "data parallelism is not implemented"),
    "--data-parallel-external-lb": ({"action": "store_true"}, "data parallelism is not implemented"),
    "--enable-multimodal-encoder-data-parallel": ({"action": "store_true"}, "multimodal input is not implemented"),
    "--disable-custom-all-reduce": ({"action": "store_true"}, "one device: there is no all-reduce"),
    "--all2all-backend": ({}, "expert parallelism is not implemented"),
    "--enable-eplb": ({"action": "store_true"}, "expert parallelism is not implemented"),
    "--eplb-config": ({}, "expert parallelism is not implemented"),
    "--expert-placement-strategy": ({}, "expert parallelism is not implemented"),
    "--enable-dbo": ({"action": "store_true"}, "dual-batch overlap needs expert parallelism"),
    "--enable-return-routed-experts": ({"action": "store_true"}, "responses carry no routed experts"),
    "--swap-space": ({"type": float}, "a preempted request is recomputed, never swapped"),
    "--cpu-offload-gb": ({"type": float}, "weights are not offloaded"),
    "--kv-offloading-size": ({"type": float}, "the KV cache is not offloaded"),
    "--kv-offloading-backend": ({}, "the KV cache is not offloaded"),
    "--kv-transfer-config": ({}, "disaggregated prefill (KV transfer) is not implemented"),
    "--kv-events-config": ({}, "KV cache events are not published"),
    "--kv-sharing-fast-prefill": ({"action": "store_true"}, "no model here shares KV across layers"),
    "--calculate-kv-scales": ({"action": "store_true"}, "fp8 KV caches are not implemented"),
    "--prefix-caching-hash-algo": ({}, "prefix-cache blocks are keyed by a chained blake2b of their tokens (and "
                                           "matched by the tokens too)"),
    "--mamba-block-size": ({"type": int}, "recurrent states are kept per request, not per block"),
    "--gdn-prefill-backend": ({}, "one Gated DeltaNet prefill implementation per platform"),
    "--disable-sliding-window": ({"action": "store_true"}, "no supported model has sliding-window layers"),
    "--disable-cascade-attn": ({"action": "store_true"}, "there is no cascade attention"),
    "--max-num-partial-prefills": ({"type": int}, "the scheduler prefills in FCFS order within the token budget"),
    "--max-long-partial-prefills": ({"type": int}, "the scheduler prefills in FCFS order within the token budget"),
    "--long-prefill-token-threshold": ({"type": int}, "the scheduler prefills in FCFS order within the token budget"),
    "--scheduling-policy": ({}, "the scheduler is first come, first served"),
    "--stream-interval": ({"type": int}, "a stream sends every token as it is made"),
    "--logprobs-mode": ({}, "logprobs are of the raw model output (vLLM's default, raw_logprobs)"),
    "--optimization-level": ({"type": int, "aliases": ["-O"]}, "what torch.compile covers is fixed (compilation.py); "
                                                               "CUDA graphs follow --compilation-config"),
    "--cuda-graph-sizes": ({"type": int, "nargs": "+"}, "decode graphs take --compilation-config "
                                                        "'{\"cudagraph_capture_sizes\": [...]}'"),
    "--max-cudagraph-capture-size": ({"type": int}, "decode graphs take --compilation-config "
                                                    "'{\"cudagraph_capture_sizes\": [...]}'"),
    "--enable-sleep-mode": ({"action": "store_true"}, "there are no /sleep and /wake_up endpoints"),
    "--safetensors-load-strategy": ({}, "safetensors files are read one after the other"),
    "--max-parallel-loading-workers": ({"type": int}, "safetensors files are read one after the other"),
    "--pt-load-map-location": ({}, ".bin weights are loaded onto the CPU, then moved"),
    "--model-loader-extra-config": ({}, "one loader reads every checkpoint"),
    "--ignore-patterns": ({"nargs": "+"}, "a download fetches the model's config, tokenizer and weight files"),
    "--allow-deprecated-quantization": ({"action": "store_true"}, "quantized checkpoints are not supported"),
    "--enable-lora": ({"action": "store_true"}, "LoRA adapters are not implemented"),
    "--lora-modules": ({"nargs": "+"}, "LoRA adapters are not implemented; a request naming one gets a 404"),
    "--max-loras": ({"type": int}, "LoRA adapters are not implemented"),
    "--max-lora-rank": ({"type": int}, "LoRA adapters are not implemented"),
    "--enable-prompt-embeds": ({"action": "store_true"}, "prompt embeddings are not taken"),
    "--logits-processors": ({"nargs": "+"}, "custom logits processors are not loaded"),
    "--reasoning-parser-plugin": ({}, "parser plugins are not loaded; the built-in reasoning parsers are listed by "
                                      "--reasoning-parser"),
    "--io-processor-plugin": ({}, "IO processor plugins are not loaded"),
    "--enable-tokenizer-info-endpoint": ({"action": "store_true"}, "there is no /tokenizer_info endpoint"),
    "--enable-log-deltas": ({"action": "store_true"}, "responses are not logged"),
    "--log-error-stack": ({"action": "store_true"}, "an unexpected error's stack is always logged; a request's "
                                                      "own error (a 4xx) is not"),
    "--tokens-only": ({"action": "store_true"}, "the OpenAI endpoints are always served"),
    "--h11-max-incomplete-event-size": ({"type": int}, "uvicorn's h11 defaults are kept"),
    "--h11-max-header-count": ({"type": int}, "uvicorn's h11 defaults are kept"),
    "--runner": ({}, "this engine runs generative models only"),
    "--convert": ({}, "this engine runs generative models only"),
    # vLLM V0 flags its V1 removed: still on older command lines
    "--enable-reasoning": ({"action": "store_true"}, "--reasoning-parser alone turns reasoning parsing on (vLLM "
                                                     "removed this flag)"),
    "--num-scheduler-steps": ({"type": int}, "vLLM V1 removed multi-step scheduling"),
    "--preemption-mode": ({}, "a preempted request is recomputed (vLLM V1 removed this flag)"),
    "--use-v2-block-manager": ({"action": "store_true"}, "vLLM V1 removed this flag"),
    "--tokenizer-pool-size": ({"type": int}, "vLLM V1 removed this flag"),
    "--max-seq-len-to-capture": ({"type": int}, "decode graphs cover max_model_len"),
    "--task": ({}, "this engine runs generative models only (vLLM replaced --task with --runner)"),
    "--num-lookahead-slots": ({"type": int}, "speculative decoding is not implemented"),
    "--pooler-config": ({}, "this engine runs generative models only"),
    "--scheduler-cls": ({}, "the built-in scheduler runs"),
    "--worker-extension-cls": ({}, "workers are not extended"),
    "--disable-hybrid-kv-cache-manager": ({"action": "store_true"}, "the KV blocks and the recurrent-state slots "
                                                                    "have one manager each"),
    "--disable-chunked-mm-input": ({"action": "store_true"}, "multimodal input is not implemented"),
    "--ray-workers-use-nsight": ({"action": "store_true"}, "no Ray executor: one process runs the model"),
    "--enable-ssl-refresh": ({"action": "store_true"}, "the TLS certificate files are read once, at start"),
    "--tool-server": ({}, "built-in tools (the Responses API's) are not served"),
    "--enable-offline-docs": ({"action": "store_true"}, "/docs loads its assets as FastAPI's default does"),
}
# Values of those flags that ask for what this engine does anyway: no warning.
NO_EFFECT_QUIET_VALUES = {
    "--data-parallel-size": (1,), "--data-parallel-size-local": (1,), "--decode-context-parallel-size": (1,),
    "--prefill-context-parallel-size": (1,), "--scheduling-policy": ("fcfs",), "--stream-interval": (1,),
    "--logprobs-mode": ("raw_logprobs",), "--runner": ("auto", "generate"), "--convert": ("auto", "none"),
    "--task": ("auto", "generate"), "--swap-space": (0,), "--cpu-offload-gb": (0,), "--num-scheduler-steps": (1,),
    "--preemption-mode": ("recompute",),
}
# vLLM flags that would change what the model computes, removed from vLLM or not: an error saying what to use.
REFUSED_FLAGS = {
    "--rope-scaling": "vLLM removed it: give the rope parameters with --hf-overrides, e.g. --hf-overrides "
                      "'{\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                      "\"original_max_position_embeddings\": 262144}}' (under \"text_config\" for Qwen3.5)",
    "--rope-theta": "vLLM removed it: give it with --hf-overrides, e.g. --hf-overrides "
                    "'{\"rope_parameters\": {\"rope_theta\": 10000000}}'",
}


def _json_flag(flag: str):
    def parse(value: str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(
                f"invalid JSON {value!r}: {e}. A correct example: {flag} {JSON_FLAG_EXAMPLES[flag]}") from None
        if flag == "--compilation-config" and type(value) is int:  # vLLM's `--compilation-config 3`: the level
            return {"level": value}
        return value
    return parse


def _list_flag(value: str) -> list[str]:
    """`--allowed-origins '["a","b"]'` (vLLM's JSON form) or a plain value."""
    if value.startswith("["):
        try:
            return [str(v) for v in json.loads(value)]
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"invalid JSON list {value!r}: {e}; example: '[\"*\"]'") from None
    return [value]


def _flag_value(ns: argparse.Namespace, flag: str):
    """The parsed value of `--some-flag` (argparse's dest: some_flag)."""
    return getattr(ns, flag.lstrip("-").replace("-", "_"))


def _port(value: str) -> int:
    """argparse type: a TCP port, 0 to 65535."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port number is needed, got {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {port}")
    return port


def register(sub) -> None:
    """Add the `serve` subcommand."""
    p = sub.add_parser("serve", help="start the OpenAI-compatible API server",
                       description="Start the OpenAI-compatible server (vLLM's `vllm serve` flags).")
    p.add_argument("model_tag", nargs="?", default=None, help="model path or repo id (default: the demo model)")
    p.add_argument("--model", default=None, help="same as the positional MODEL")
    p.add_argument("--config", dest="config_file", default=None, metavar="FILE",
                   help="a YAML file of flags (`max-model-len: 4096`, `enforce-eager: true`), as vLLM's; flags on "
                        "the command line win over it")
    add_engine_flags(p)
    add_server_flags(p)
    p.set_defaults(func=run)


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """The frontend flags of `vllm serve`, plus the accepted-but-inert ones."""
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000; 0: any free port)")
    p.add_argument("--uds", default=None, help="listen on this Unix domain socket instead of --host / --port")
    p.add_argument("--root-path", default=None, help="the path prefix a reverse proxy serves the API under")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    p.add_argument("--ssl-certfile", default=None, help="... and this certificate (PEM)")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates for client certificates")
    p.add_argument("--ssl-cert-reqs", type=int, default=0, help="client certificates: 0 none, 1 optional, 2 required")
    p.add_argument("--ssl-ciphers", default=None, help="the TLS ciphers to allow (OpenSSL cipher list)")
    p.add_argument("--log-config-file", default=None,
                   help="a logging config file (JSON, YAML or ini) for uvicorn's loggers")
    p.add_argument("--middleware", action="append", default=[],
                   help="import path of an ASGI middleware class, or of an async function(request, call_next) "
                        "(repeatable)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="answer with an X-Request-Id header (the request's own, else a fresh id)")
    p.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    p.add_argument("--enable-server-load-tracking", action="store_true",
                   help="count the chat / completion requests in flight, served at GET /load")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model name(s) requests use (default: the model argument)")
    p.add_argument("--hf-overrides", type=_json_flag("--hf-overrides"), default=None)
    p.add_argument("--compilation-config", type=_json_flag("--compilation-config"), default=None,
                   help='cudagraph_mode FULL_DECODE_ONLY (or FULL, FULL_AND_PIECEWISE) captures decode steps as CUDA '
                        'graphs on a GPU, e.g. \'{"cudagraph_mode":"FULL_DECODE_ONLY"}\'; other keys have no effect')
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--tool-call-parser", default=None)
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="tool_choice none: render the prompt without the tools")
    p.add_argument("--default-chat-template-kwargs", type=_json_flag("--default-chat-template-kwargs"), default=None,
                   help='chat template kwargs for every request, under its own chat_template_kwargs, e.g. '
                        '\'{"enable_thinking":false}\'')
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with a usage chunk, whatever its stream_options")
    p.add_argument("--chat-template", default=None, help="a Jinja file or template string")
    p.add_argument("--trust-request-chat-template", action="store_true")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 (or VLLM_API_KEY)")
    p.add_argument("--allowed-origins", type=_list_flag, nargs="+", default=None)
    p.add_argument("--allowed-methods", type=_list_flag, nargs="+", default=None)
    p.add_argument("--allowed-headers", type=_list_flag, nargs="+", default=None)
    p.add_argument("--allow-credentials", action="store_true")
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's id, prompt length and sampling parameters (off by default, as vLLM's)")
    p.add_argument("--disable-log-requests", action="store_true", help="vLLM's older switch; requests are not "
                                                                       "logged unless --enable-log-requests")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="at most this many characters (and token ids) of a logged prompt")
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput / cache log line")
    p.add_argument("--hf-token", default=None, help="token for gated Hugging Face downloads (sets HF_TOKEN)")
    p.add_argument("--shutdown-timeout", type=float, default=0.0,
                   help="on SIGTERM / SIGINT: seconds in-flight requests may run on before they are aborted (0, the "
                        "default: aborted at once, their streams ending with finish_reason 'abort')")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="(ascendserve) answer 503 with Retry-After once this many sequences wait for a slot")
    for flag, (kwargs, _) in NO_EFFECT_FLAGS.items():
        kwargs = dict(kwargs)
        if flag in JSON_FLAG_EXAMPLES:  # a JSON flag is one with an example to show when its value does not parse
            kwargs["type"] = _json_flag(flag)
        p.add_argument(flag, *kwargs.pop("aliases", ()), default=None, **kwargs)
    for flag in REFUSED_FLAGS:
        p.add_argument(flag, default=None, help=argparse.SUPPRESS)


def warn_no_effect_flags(ns: argparse.Namespace) -> list[str]:
    """One warning per inert flag the user set; returns the flags warned about."""
    warned = []
    for flag, (_, why) in NO_EFFECT_FLAGS.items():
        value = _flag_value(ns, flag)
        if value is None or value is False or value in NO_EFFECT_QUIET_VALUES.get(flag, ()):
            continue
        logger.warning("%s %s is accepted but has no effect: %s.", flag,
                       json.dumps(value) if not isinstance(value, str) else value, why)
        warned.append(flag)
    if ns.quantization in CHECKPOINT_QUANTIZATION_METHODS:
        # vLLM's checkpoint methods (`ascend`, fp8, awq, ...): accepted as before, weights load as stored.
        logger.warning("--quantization %s is accepted but has no effect: quantized checkpoints are not supported; "
                       "weights load as stored (weight-only %s are the supported values).",
                       ns.quantization, " / ".join(QUANTIZATION_METHODS))
        warned.append("--quantization")
        ns.quantization = None
    return warned


def log_stats_interval() -> float:
    """Seconds between the stats log lines: VLLM_LOG_STATS_INTERVAL, 10 unless set. As vLLM's, 0 or less means the
    default (said once here: it was a busy loop of log lines); ValueError naming it for a value that is no number."""
    from ascendserve.entrypoints.openai.api_server import DEFAULT_LOG_STATS_INTERVAL_S

    value = os.environ.get("VLLM_LOG_STATS_INTERVAL")
    if value is None:
        return DEFAULT_LOG_STATS_INTERVAL_S
    try:
        interval = float(value)
    except ValueError:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL must be a number of seconds (between the stats log lines; "
                         f"{DEFAULT_LOG_STATS_INTERVAL_S:g} unless set), got {value!r}") from None
    if not interval > 0:  # NaN too
        logger.warning("VLLM_LOG_STATS_INTERVAL=%s is not above 0: the stats are logged every %g s, as vLLM does.",
                       value, DEFAULT_LOG_STATS_INTERVAL_S)
        return DEFAULT_LOG_STATS_INTERVAL_S
    return interval


def http_keep_alive_s() -> float:
    """Seconds an idle HTTP keep-alive connection stays open: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, vLLM's 5 unless set;
    ValueError naming it for a value that is no number of seconds >= 0."""
    value = os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE")
    if value is None:
        return DEFAULT_HTTP_KEEP_ALIVE_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:
        raise ValueError(f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be a number of seconds >= 0 (how long an idle "
                         f"keep-alive connection stays open; {DEFAULT_HTTP_KEEP_ALIVE_S:g} unless set), got {value!r}")
    return seconds


def check_flags(ns: argparse.Namespace) -> None:
    """Fail fast (before loading the model) on values that cannot work; raises ValueError."""
    from ascendserve.engine.sampling_params import max_n_sequences
    from ascendserve.layers.compact_linear import forced_bf16_large_batches
    from ascendserve.layers.linear import forced_gemm
    from ascendserve.platforms.cpu import kv_cache_space_bytes, omp_threads_bind
    from ascendserve.parsers.reasoning import get_reasoning_parser
    from ascendserve.parsers.tool import get_tool_parser

    check_parallelism(ns.tensor_parallel_size, ns.pipeline_parallel_size)  # first: the one line a user must read
    for flag, why in REFUSED_FLAGS.items():
        if _flag_value(ns, flag) is not None:
            raise ValueError(f"{flag} is not taken: {why}")
    for flag in ("--runner", "--convert", "--task"):
        value, generative = _flag_value(ns, flag), NO_EFFECT_QUIET_VALUES[flag]
        if value is not None and value not in generative:
            raise ValueError(f"{flag} {value}: this engine runs generative models only (pooling, embedding and "
                             f"scoring models are not implemented); {flag} may be {' or '.join(generative)}")
    forced_gemm()  # the CPU linears' environment switches: an unknown value stops here, not mid-load
    forced_bf16_large_batches()
    max_n_sequences()  # the environment's other numbers: read once now, so a typo is not a 400 on every request
    kv_cache_space_bytes()  # (and not an error after the weights have loaded)
    omp_threads_bind()
    ns.log_stats_interval = None if ns.disable_log_stats else log_stats_interval()  # read once: serve() takes it
    ns.http_keep_alive_s = http_keep_alive_s()

    if ns.reasoning_parser:
        get_reasoning_parser(ns.reasoning_parser)
    if ns.tool_call_parser:
        get_tool_parser(ns.tool_call_parser)
    for flag, example in JSON_FLAG_EXAMPLES.items():
        value = _flag_value(ns, flag)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{flag} must be a JSON object, got {json.dumps(value)}; example: {flag} {example}")
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (e.g. --tool-call-parser qwen3_coder)")
    if ns.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {ns.shutdown_timeout}")
    if ns.max_waiting_requests is not None and ns.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {ns.max_waiting_requests}")
    if ns.max_log_len is not None and ns.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {ns.max_log_len}")
    if bool(ns.ssl_keyfile) != bool(ns.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both to serve HTTPS")
    for path in (ns.ssl_keyfile, ns.ssl_certfile, ns.ssl_ca_certs, ns.log_config_file):
        if path and not os.path.isfile(path):
            raise ValueError(f"no such file: {path}")
    for name in ns.middleware:
        load_middleware(name)


def run(ns: argparse.Namespace) -> int:
    """Validate the flags, build the engine, serve until interrupted."""
    ns.model = ns.model or ns.model_tag
    ns.api_key = ns.api_key or os.environ.get("VLLM_API_KEY") or None
    if ns.hf_token:
        os.environ["HF_TOKEN"] = ns.hf_token  # huggingface_hub's downloads read it
    try:
        check_flags(ns)
        warn_no_effect_flags(ns)  # before engine_args_from: it drops a checkpoint --quantization value
        args = engine_args_from(ns)
        from ascendserve.entrypoints.openai.chat_utils import load_chat_template
        chat_template = load_chat_template(ns.chat_template)
    except ValueError as e:
        print(f"ascendserve serve: error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("VLLM_USE_MODELSCOPE", "").lower() in ("1", "true") and ns.model:
        logger.info("VLLM_USE_MODELSCOPE is set: %s is resolved from ModelScope", ns.model)
    try:  # before the model loads (minutes for a large one), as vLLM does: a taken port fails at once
        sock = bind_socket(ns)
    except OSError as e:
        where = ns.uds or f"{ns.host}:{ns.port}"
        print(f"ascendserve serve: error: cannot listen on {where}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        serve(ns, args, chat_template, sock)
    except StartupError as e:  # a wrong model, file or size found while loading: one line, as for a bad flag
        print(f"ascendserve serve: error: {e}", file=sys.stderr)
        return 2
    return 0


class StartupError(Exception):
    """The engine could not be built from the command line's model and flags (the message says why)."""


def bind_socket(ns: argparse.Namespace):
    """The listening socket of --uds, or of --host / --port (IPv6 for an IPv6 address); raises OSError."""
    import ipaddress
    import socket

    if ns.uds:
        _remove_stale_socket(ns.uds)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = ns.uds
    else:
        try:
            family = socket.AF_INET6 if ipaddress.ip_address(ns.host).version == 6 else socket.AF_INET
        except ValueError:  # a host name
            family = socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        address = (ns.host, ns.port)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _remove_stale_socket(path: str) -> None:
    """Remove the socket file at `path` that an earlier run left (nothing listens on it); raise OSError
    (EADDRINUSE) when a server still listens there. Anything else at `path` is left for bind() to refuse."""
    import errno
    import socket
    import stat

    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return
    except FileNotFoundError:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:  # nobody listens: stale
            os.unlink(path)
            return
        except OSError:
            return
    raise OSError(errno.EADDRINUSE, "Address already in use (another server listens on this socket)")


def _remove_socket_file(path: str) -> None:
    """The --uds socket file, once the server has stopped (as uvicorn does for a socket it binds itself)."""
    import stat

    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


def load_middleware(name: str):
    """The object `--middleware package.module.Name` names; raises ValueError naming what is wrong."""
    import importlib

    module_name, _, attr = name.rpartition(".")
    try:
        middleware = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--middleware {name}: cannot import it ({e})") from None
    if middleware is None or not callable(middleware):
        raise ValueError(f"--middleware {name}: an import path of an ASGI middleware class or of an async "
                         f"function(request, call_next) is needed")
    return middleware


def uvicorn_config(ns: argparse.Namespace, app):
    """uvicorn's config of the server flags (the socket is bound already: host / port only name it in logs)."""
    import uvicorn

    # Past the drain, uvicorn cancels what still runs (a client that does not read its finished stream, say).
    return uvicorn.Config(app, host=ns.host, port=ns.port, uds=ns.uds,
                          log_level=ns.uvicorn_log_level, access_log=not ns.disable_uvicorn_access_log,
                          log_config=ns.log_config_file or uvicorn.config.LOGGING_CONFIG,
                          timeout_keep_alive=ns.http_keep_alive_s,
                          timeout_graceful_shutdown=ns.shutdown_timeout + SHUTDOWN_GRACE_S,
                          ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile, ssl_ca_certs=ns.ssl_ca_certs,
                          ssl_cert_reqs=ns.ssl_cert_reqs, **({"ssl_ciphers": ns.ssl_ciphers} if ns.ssl_ciphers else {}))


def serve(ns: argparse.Namespace, args, chat_template: str | None, sock) -> None:
    """Build engine and app, then run uvicorn on the bound socket `sock` (blocks)."""
    from ascendserve.engine.async_engine import AsyncLLM
    from ascendserve.engine.llm_engine import LLMEngine
    from ascendserve.entrypoints.openai.api_server import FrontendOptions, build_app
    from ascendserve.entrypoints.openai.serving_engine import ServerOptions
    from ascendserve.entrypoints.openai.serving_models import ServingModels
    from ascendserve.metrics import EngineMetrics

    try:
        engine = LLMEngine.from_engine_args(args)
    except STARTUP_ERRORS as e:
        sock.close()
        raise StartupError(str(e)) from e
    config = engine.config
    names = ns.served_model_name or [config.served_model_name]
    metrics = EngineMetrics(names[0], config.max_model_len, device_type=config.device.type)
    async_llm = AsyncLLM(engine, metrics)
    reasoning_cls, tool_cls = _parser_classes(ns, engine.tokenizer)
    options = ServerOptions(
        max_waiting_requests=ns.max_waiting_requests, max_logprobs=ns.max_logprobs,
        log_requests=ns.enable_log_requests and not ns.disable_log_requests, max_log_len=ns.max_log_len,
        chat_template=chat_template,
        trust_request_chat_template=ns.trust_request_chat_template, reasoning_parser=ns.reasoning_parser,
        tool_call_parser=ns.tool_call_parser, enable_auto_tool_choice=ns.enable_auto_tool_choice,
        default_chat_template_kwargs=ns.default_chat_template_kwargs,
        exclude_tools_when_tool_choice_none=ns.exclude_tools_when_tool_choice_none,
        enable_force_include_usage=ns.enable_force_include_usage,
        default_sampling_params=engine.default_sampling_params)
    cors = {"allowed_origins": _flat(ns.allowed_origins), "allowed_methods": _flat(ns.allowed_methods),
            "allowed_headers": _flat(ns.allowed_headers), "allow_credentials": ns.allow_credentials}
    frontend = FrontendOptions(docs=not ns.disable_fastapi_docs, request_id_headers=ns.enable_request_id_headers,
                               middleware=[load_middleware(name) for name in ns.middleware],
                               load_tracking=ns.enable_server_load_tracking, root_path=ns.root_path or "")
    app = build_app(async_llm, ServingModels(names, config.model_path, config.max_model_len), options,
                    metrics=metrics, api_keys=[ns.api_key] if ns.api_key else [], cors=cors,
                    reasoning_parser_cls=reasoning_cls, tool_parser_cls=tool_cls,
                    log_stats_interval=ns.log_stats_interval, frontend=frontend)
    scheme = "https" if ns.ssl_certfile else "http"
    where = f"unix socket {ns.uds}" if ns.uds else f"{scheme}://{ns.host}:{ns.port}{ns.root_path or ''}"
    logger.info("Serving %s on %s (OpenAI API under /v1)", names[0], where)
    on_stopped = (lambda: _remove_socket_file(ns.uds)) if ns.uds else None
    try:
        _run_server(uvicorn_config(ns, app), sock, lambda: _drain_or_abort(async_llm, ns.shutdown_timeout),
                    on_stopped)
    finally:
        async_llm.shutdown()
        sock.close()


# Seconds uvicorn's graceful shutdown gives connections after --shutdown-timeout has aborted the requests.
SHUTDOWN_GRACE_S = 5.0


def _run_server(config, sock, on_exit, on_stopped=None) -> None:
    """uvicorn's server on `sock`, which calls `on_exit` on the first exit signal, before it stops taking
    connections, and `on_stopped` once it has closed them (before uvicorn raises a SIGTERM again, whose default
    action ends the process: code after this call does not run then)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                on_exit()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            try:
                await super().shutdown(sockets)
            finally:
                if on_stopped is not None:
                    on_stopped()

    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # SIGINT, raised again once uvicorn has stopped (uvicorn.run swallows it too)
        pass


def _drain_or_abort(async_llm, timeout_s: float) -> None:
    """SIGTERM / SIGINT (vLLM's --shutdown-timeout): abort every request now, or after `timeout_s` seconds of drain.
    uvicorn meanwhile takes no new connections and ends each open one once its response is done; a request that still
    arrives on one is refused (503)."""
    async_llm.begin_shutdown()
    if timeout_s <= 0:
        logger.info("Shutting down: aborting the requests in flight (--shutdown-timeout 0)")
        async_llm.abort_all()
        return
    logger.info("Shutting down: requests in flight may finish within %.0f s (--shutdown-timeout)", timeout_s)
    timer = threading.Timer(timeout_s, async_llm.abort_all)
    timer.daemon = True
    timer.start()


def _flat(values: list[list[str]] | None) -> list[str]:
    return [v for group in values for v in group] if values else ["*"]


def _parser_classes(ns: argparse.Namespace, tokenizer):
    """The parser classes to use; one that cannot work with this tokenizer is switched off with a warning."""
    from ascendserve.parsers.reasoning import get_reasoning_parser
    from ascendserve.parsers.tool import get_tool_parser

    reasoning = get_reasoning_parser(ns.reasoning_parser) if ns.reasoning_parser else None
    if reasoning is not None:
        try:
            reasoning(tokenizer)
        except (ValueError, RuntimeError) as e:
            logger.warning("--reasoning-parser %s is switched off for this model: %s", ns.reasoning_parser, e)
            reasoning = None
    tool = get_tool_parser(ns.tool_call_parser) if ns.tool_call_parser else None
    return reasoning, tool
