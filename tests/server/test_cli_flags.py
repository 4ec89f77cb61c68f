"""`ascendserve serve` flags: vLLM command lines parse, bad values stop start-up, inert flags warn once each."""

import logging
import os
import shlex
import subprocess
import sys

import pytest

from ascendserve.cli import serve as serve_cli
from ascendserve.cli.engine_flags import human_readable_int
from ascendserve.cli.main import build_parser, main

USER_LINE = ("serve Qwen/Qwen3.5-27B --tensor-parallel-size 1 --reasoning-parser qwen3 "
             "--tool-call-parser qwen3_coder --enable-auto-tool-choice --max-model-len 32768 "
             "--gpu-memory-utilization 0.9 --served-model-name qwen3.5 --port 8000 --host 0.0.0.0")
ASCEND_LINE = (
    "serve Eco-Tech/Qwen3.5-397B-A17B-w8a8-mtp --data-parallel-size 1 --tensor-parallel-size 1 "
    "--enable-expert-parallel --seed 1024 --quantization ascend --served-model-name qwen3.5 "
    "--max-num-seqs 128 --max-model-len 133000 --max-num-batched-tokens 16384 --trust-remote-code "
    "--gpu-memory-utilization 0.90 --enable-prefix-caching --no-enable-prefix-caching --block-size 128 "
    "--speculative-config '{\"method\": \"qwen3_5_mtp\", \"num_speculative_tokens\": 3, \"enforce_eager\": true}' "
    "--compilation-config '{\"cudagraph_mode\":\"FULL_DECODE_ONLY\"}' "
    "--additional-config '{\"enable_cpu_binding\":true, \"enable_fused_mc2\":1}' --async-scheduling "
    "--enforce-eager --dtype bfloat16 --allowed-local-media-path / --limit-mm-per-prompt '{\"image\": 2}' "
    "--skip-mm-profiling --max-logprobs 10 --worker-use-ray --distributed-executor-backend mp "
    "--uvicorn-log-level warning --disable-log-requests --api-key abc --allowed-origins '[\"http://a\"]' "
    "--allowed-methods GET POST --allowed-headers '[\"*\"]' --chat-template '{{ messages }}'")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings():
    handler = _Records()
    logger = logging.getLogger("ascendserve")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


@pytest.fixture
def started(monkeypatch):
    """Run `main()` up to the point where the engine would load; return what it would serve with."""
    seen = {}

    def fake_serve(ns, args, chat_template, sock):
        seen.update(ns=ns, args=args, chat_template=chat_template, sock=sock)
    monkeypatch.setattr(serve_cli, "serve", fake_serve)
    monkeypatch.setattr(serve_cli, "bind_socket", lambda ns: None)  # the lines name port 8000: left alone
    return seen


def test_users_vllm_line_parses(started):
    assert main(shlex.split(USER_LINE)) == 0
    args = started["args"]
    assert args.model == "Qwen/Qwen3.5-27B" and args.max_model_len == 32768
    assert started["ns"].served_model_name == ["qwen3.5"] and started["ns"].enable_auto_tool_choice


def test_ascend_line_parses_and_warns_once_per_inert_flag(started, warnings):
    assert main(shlex.split(ASCEND_LINE)) == 0
    ns, args = started["ns"], started["args"]
    assert args.enable_prefix_caching is False and args.block_size == 128 and args.seed == 1024
    assert args.async_scheduling
    assert ns.compilation_config == args.compilation_config == {"cudagraph_mode": "FULL_DECODE_ONLY"}  # read now
    assert ns.additional_config == {"enable_cpu_binding": True, "enable_fused_mc2": 1}
    assert ns.limit_mm_per_prompt == {"image": 2} and ns.max_logprobs == 10
    assert ns.allowed_origins == [["http://a"]] and started["chat_template"] == "{{ messages }}"
    inert = ["--enable-expert-parallel", "--quantization", "--speculative-config", "--additional-config", "--allowed-local-media-path", "--limit-mm-per-prompt",
             "--skip-mm-profiling", "--worker-use-ray", "--distributed-executor-backend"]
    for flag in inert:
        assert sum(m.startswith(flag + " ") for m in warnings) == 1, (flag, warnings)
    assert not any(m.startswith("--data-parallel-size ") for m in warnings)  # 1 is what we do anyway
    assert len(warnings) == len(inert)


def test_structured_output_backend_flags_parse_and_warn(started, warnings):
    """vLLM's backend choice for structured outputs: accepted, one warning each (llguidance runs whatever is named)."""
    line = "serve --structured-outputs-config '{\"backend\": \"xgrammar\"}' --guided-decoding-backend xgrammar"
    assert main(shlex.split(line)) == 0
    for flag in ("--structured-outputs-config", "--guided-decoding-backend"):
        assert sum(m.startswith(flag + " ") and "llguidance" in m for m in warnings) == 1, (flag, warnings)


def assert_warned_once_each(warnings: list[str], flags: list[str]) -> None:
    """One warning line per inert flag, and no other."""
    for flag in flags:
        assert sum(m.startswith(flag + " ") for m in warnings) == 1, (flag, warnings)
    assert len(warnings) == len(flags), warnings


def test_qwen3_5_chat_flags_parse(started, warnings):
    """Flags of public Qwen3.5 `vllm serve` lines: the chat ones act (options checked in test_serving_chat_stream),
    the rest warn once each; qwen3_xml is the qwen3_coder parser."""
    line = ("serve --tool-call-parser qwen3_xml --enable-auto-tool-choice --reasoning-parser qwen3 "
            "--default-chat-template-kwargs '{\"enable_thinking\": false}' --exclude-tools-when-tool-choice-none "
            "--enable-force-include-usage --chat-template-content-format string --enable-prompt-tokens-details "
            "--return-tokens-as-token-ids --response-role assistant --tool-parser-plugin /x/plugin.py")
    assert main(shlex.split(line)) == 0
    ns = started["ns"]
    assert ns.default_chat_template_kwargs == {"enable_thinking": False}
    assert ns.exclude_tools_when_tool_choice_none and ns.enable_force_include_usage
    assert_warned_once_each(warnings, ["--chat-template-content-format", "--enable-prompt-tokens-details",
                                       "--return-tokens-as-token-ids", "--response-role", "--tool-parser-plugin"])
    assert main(["serve", "--default-chat-template-kwargs", "[1]"]) == 2


def test_vllm_multimodal_flags_parse(started, warnings):
    """The Qwen3.5 model card's multimodal flags (the vision tower is not implemented): each warns once; they were
    'unrecognized arguments'."""
    line = ("serve --mm-processor-kwargs '{\"max_pixels\": 1003520}' --media-io-kwargs '{\"video\": {\"num_frames\": "
            "32}}' --mm-processor-cache-type shm --mm-shm-cache-max-object-size-mb 128 --mm-encoder-attn-backend "
            "FLASH_ATTN --interleave-mm-strings --video-pruning-rate 0.5 --allowed-media-domains a.com b.com "
            "--enable-mm-embeds")
    assert main(shlex.split(line)) == 0
    assert started["ns"].allowed_media_domains == ["a.com", "b.com"]
    assert_warned_once_each(warnings, ["--mm-processor-kwargs", "--media-io-kwargs", "--mm-processor-cache-type",
                                       "--mm-shm-cache-max-object-size-mb", "--mm-encoder-attn-backend",
                                       "--interleave-mm-strings", "--video-pruning-rate", "--allowed-media-domains",
                                       "--enable-mm-embeds"])


def test_the_rest_of_vllms_engine_flags_parse(started, warnings):
    """vLLM's parallelism, memory, scheduler, loader, LoRA and V0 flags: each warns once (they were 'unrecognized
    arguments'); a value that asks for what this engine does anyway (fcfs, raw logprobs, the generate runner) does
    not warn."""
    noisy = ("--decode-context-parallel-size 2 --data-parallel-backend ray --disable-custom-all-reduce --enable-eplb "
             "--eplb-config '{\"window_size\": 1000}' --swap-space 4 --cpu-offload-gb 2 --kv-transfer-config "
             "'{\"kv_connector\": \"LMCacheConnectorV1\", \"kv_role\": \"kv_both\"}' --prefix-caching-hash-algo "
             "sha256 --mamba-block-size 128 --max-num-partial-prefills 2 --long-prefill-token-threshold 512 "
             "--scheduling-policy priority --stream-interval 4 -O3 --cuda-graph-sizes 1 2 4 --enable-sleep-mode "
             "--safetensors-load-strategy lazy --ignore-patterns original/* --enable-lora --lora-modules a=/x "
             "--max-loras 2 --logits-processors pkg:Cls --reasoning-parser-plugin /x.py --enable-reasoning "
             "--num-scheduler-steps 8 --preemption-mode swap --h11-max-header-count 64 --num-lookahead-slots 4 "
             "--pooler-config '{\"pooling_type\": \"MEAN\"}' --scheduler-cls pkg.Sched --worker-extension-cls pkg.Ext "
             "--disable-hybrid-kv-cache-manager --disable-chunked-mm-input --ray-workers-use-nsight "
             "--enable-ssl-refresh --tool-server demo --enable-offline-docs")
    quiet = ("--prefill-context-parallel-size 1 --scheduling-policy fcfs --stream-interval 1 --logprobs-mode "
             "raw_logprobs --runner generate --convert none --task generate --swap-space 0")
    assert main(["serve", *shlex.split(quiet)]) == 0 and not warnings
    assert main(["serve", *shlex.split(noisy)]) == 0
    ns = started["ns"]
    assert ns.optimization_level == 3 and ns.cuda_graph_sizes == [1, 2, 4] and ns.lora_modules == ["a=/x"]
    assert ns.kv_transfer_config == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert ns.pooler_config == {"pooling_type": "MEAN"} and ns.num_lookahead_slots == 4
    assert_warned_once_each(warnings, sorted({arg for arg in shlex.split(noisy) if arg.startswith("-")} - {"-O3"})
                            + ["--optimization-level"])


@pytest.mark.parametrize("argv, message", [
    (["--rope-scaling", '{"rope_type": "yarn", "factor": 4.0}'],
     "--rope-scaling is not taken: vLLM removed it: give the rope parameters with --hf-overrides"),
    (["--rope-theta", "1e6"], "--rope-theta is not taken"),
    (["--runner", "pooling"], "--runner pooling: this engine runs generative models only"),
    (["--convert", "embed"], "--convert embed: this engine runs generative models only"),
    (["--task", "embed"], "--task may be auto or generate"),
])
def test_flags_that_would_change_the_model_are_refused(started, capsys, argv, message):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not started


def test_vllm_loading_flags_parse(started, warnings, monkeypatch):
    """The loading flags of vLLM command lines: the generation-config pair, --hf-token and a human-readable
    --max-model-len act; the rest warn once each (the token itself is never logged)."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    line = ("serve m --generation-config vllm --override-generation-config '{\"temperature\": 0.5}' "
            "--max-model-len 32K --hf-token hf_secret --tokenizer-revision v2 --tokenizer-mode auto "
            "--load-format safetensors --download-dir /tmp/x --code-revision main --config-format hf --model-impl vllm "
            "--hf-config-path /tmp/c")
    assert main(shlex.split(line)) == 0
    args = started["args"]
    assert args.generation_config == "vllm" and args.override_generation_config == {"temperature": 0.5}
    assert args.max_model_len == 32768 and os.environ["HF_TOKEN"] == "hf_secret" and args.tokenizer_revision == "v2"
    assert_warned_once_each(warnings, ["--tokenizer-mode", "--load-format", "--download-dir",
                                       "--code-revision", "--config-format", "--model-impl", "--hf-config-path"])
    assert not any("hf_secret" in m for m in warnings)


@pytest.mark.parametrize("text, value", [("32768", 32768), ("32k", 32000), ("32K", 32768), ("1.5k", 1500),
                                         ("1m", 10**6), ("1M", 2**20)])
def test_human_readable_max_model_len(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("flag", sorted(serve_cli.JSON_FLAG_EXAMPLES))
def test_bad_json_flag_stops_with_value_error_and_example(flag, capsys):
    """Every JSON flag, the inert ones too (a bad --eplb-config or --kv-transfer-config was a KeyError traceback:
    they had no example)."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", flag, "{cudagraph_mode: FULL}"])
    assert info.value.code != 0
    err = capsys.readouterr().err
    assert "{cudagraph_mode: FULL}" in err and "Expecting property name" in err
    assert f"A correct example: {flag} '{{" in err


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "argument --port: a port is 0 to 65535, got 70000"),  # was an OverflowError traceback
    (["--port", "http"], "argument --port: a port number is needed, got 'http'"),
])
def test_bad_flag_types_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flag, text, value", [("--max-num-batched-tokens", "8K", 8192),
                                                ("--max-model-len", "auto", -1), ("--max-model-len", "-1", -1),
                                                ("--kv-cache-memory-bytes", "4G", 4 * 2**30),
                                                ("--kv-cache-memory-bytes", "1.5g", 1_500_000_000)])
def test_vllms_human_readable_sizes(started, flag, text, value):
    """vLLM reads these two (as --max-model-len) with k / m / g suffixes; `4G` was 'invalid int value'."""
    assert main(["serve", flag, text]) == 0
    assert getattr(started["args"], flag.lstrip("-").replace("-", "_")) == value


def test_an_integer_compilation_config_is_vllms_level(started, caplog):
    assert main(["serve", "--compilation-config", "3"]) == 0
    assert started["args"].compilation_config == {"level": 3}
    assert "compilation_config keys ['level'] are accepted but have no effect" in caplog.text


def test_bad_json_exit_code_in_a_real_process():
    proc = subprocess.run([sys.executable, "-m", "ascendserve.cli.main", "serve", "--compilation-config", "FULL"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "'FULL'" in proc.stderr and '--compilation-config \'{"cudagraph_mode":"FULL_DECODE_ONLY"}\'' in proc.stderr


@pytest.mark.parametrize("model, message", [
    ("missing", "Model '{path}' was not found"),
    ("bad-config", "It looks like the config file at '{path}/config.json' is not a valid JSON file"),
])
def test_a_model_that_fails_to_load_is_one_error_line_in_a_real_process(tmp_path, model, message):
    """What loading finds wrong (no such model, a broken config, truncated weights, a KV cache too small) is one
    `error:` line and exit 2, as a bad flag: it was a traceback ending in the message, and exit 1."""
    path = tmp_path / model
    if model == "bad-config":
        path.mkdir()
        (path / "config.json").write_text("{")
    proc = subprocess.run([sys.executable, "-m", "ascendserve.cli.main", "serve", str(path), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"ascendserve serve: error: {message.format(path=path)}" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "2"], "tensor_parallel_size must be 1"),
    (["--pipeline-parallel-size", "2"], "pipeline_parallel_size must be 1 for now (pipeline parallelism is not "
                                        "implemented yet"),  # it was an inert flag: a warning, then one device
    (["--quantization", "bogus"], "quantization must be one of [None, 'int8', 'int4'] (weight-only, applied at load), "
                                  "got 'bogus'"),  # it was a warning, and the server started unquantized
    (["--hf-overrides", "[1, 2]"], "--hf-overrides must be a JSON object, got [1, 2]; example: --hf-overrides '{"),
    (["--compilation-config", "[3]"], "--compilation-config must be a JSON object, got [3]"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    (["--tool-call-parser", "nope"], "known tool-call parsers: hermes, qwen3_coder"),
    (["--reasoning-parser", "nope"], "known reasoning parsers"),
    (["--chat-template", "no-such-file.jinja"], "neither an existing file nor a Jinja template"),
    (["--chat-template", "{% for m in messages %}{{ m.content }"],  # was a 400 on every chat request
     "--chat-template: the template string is not a valid Jinja template: unexpected '}' (line 1)"),
    (["--max-waiting-requests", "-1"], "--max-waiting-requests must be >= 0"),
    (["--max-num-seqs", "0"], "max_num_seqs must be a positive integer"),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype 'fp8' is not supported: fp8 KV caches are not implemented"),
    (["--kv-cache-dtype", "int8"], "kv_cache_dtype must be one of ['auto', 'bfloat16', 'float16'], got 'int8'"),
    (["--mamba-ssm-cache-dtype", "fp8"],
     "mamba_ssm_cache_dtype must be one of ['auto', 'float32', 'bfloat16', 'float16'], got 'fp8'"),
    (["--mamba-cache-dtype", "half"], "mamba_cache_dtype must be one of"),
])
def test_bad_values_stop_before_loading(started, capsys, argv, message):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not started  # the engine was never built


@pytest.mark.parametrize("env, message", [
    ("ASCENDSERVE_FP32_GEMM", "ASCENDSERVE_FP32_GEMM='bogus' is not one of panel, onednn, mkl"),
    ("ASCENDSERVE_BF16_LARGE_BATCHES", "ASCENDSERVE_BF16_LARGE_BATCHES='bogus' is not one of kernel, widen"),
])
def test_bad_kernel_environment_stops_before_loading(started, capsys, monkeypatch, env, message):
    monkeypatch.setenv(env, "bogus")
    assert main(["serve"]) == 2
    assert message in capsys.readouterr().err
    assert not started


@pytest.mark.parametrize("env, value, message", [
    # was a ValueError traceback after the model had loaded
    ("VLLM_LOG_STATS_INTERVAL", "abc", "VLLM_LOG_STATS_INTERVAL must be a number of seconds (between the stats log "
                                       "lines; 10 unless set), got 'abc'"),
    # was a 400 'invalid literal for int()' on every request
    ("VLLM_MAX_N_SEQUENCES", "abc", "VLLM_MAX_N_SEQUENCES must be a positive integer"),
    ("VLLM_MAX_N_SEQUENCES", "0", "VLLM_MAX_N_SEQUENCES must be a positive integer"),
    ("VLLM_CPU_KVCACHE_SPACE", "40G", "VLLM_CPU_KVCACHE_SPACE must be the KV cache size in GiB"),
    ("VLLM_CPU_OMP_THREADS_BIND", "0-3;4-7", "VLLM_CPU_OMP_THREADS_BIND must list cores such as 0-31"),
    ("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5s", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be a number of seconds >= 0 (how long "
                                           "an idle keep-alive connection stays open; 5 unless set), got '5s'"),
    ("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "-1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be a number of seconds >= 0"),
])
def test_bad_vllm_environment_stops_before_loading(started, capsys, monkeypatch, env, value, message):
    monkeypatch.setenv(env, value)
    assert main(["serve"]) == 2
    assert message in capsys.readouterr().err
    assert not started


@pytest.mark.parametrize("value, interval", [(None, 10.0), ("2.5", 2.5), ("0", 10.0), ("-1", 10.0)])
def test_log_stats_interval_as_vllm_reads_it(monkeypatch, caplog, value, interval):
    """0 or less is vLLM's default, with a warning (a negative interval was a busy loop of stats lines)."""
    if value is not None:
        monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", value)
    assert serve_cli.log_stats_interval() == interval
    assert ("is not above 0" in caplog.text) == (value in ("0", "-1"))


def test_the_stats_interval_is_read_once_at_start(started, monkeypatch, caplog):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "-1")
    assert main(["serve"]) == 0 and started["ns"].log_stats_interval == 10.0
    assert caplog.text.count("is not above 0") == 1
    assert main(["serve", "--disable-log-stats"]) == 0 and started["ns"].log_stats_interval is None


@pytest.mark.parametrize("value, seconds", [(None, 5.0), ("30", 30.0), ("0.5", 0.5)])
def test_http_keep_alive_as_vllm_reads_it(started, monkeypatch, value, seconds):
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE reaches uvicorn (it was a fixed 5 s)."""
    if value is not None:
        monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", value)
    assert main(["serve"]) == 0
    assert serve_cli.uvicorn_config(started["ns"], app=None).timeout_keep_alive == seconds


def test_a_chat_template_file_is_compiled_at_start(started, capsys, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}\n{{ m.content }}\n{% endfor %}\n{% if x %}")
    assert main(["serve", "--chat-template", str(path)]) == 2
    assert f"--chat-template: {path} is not a valid Jinja template: Unexpected end of template" in capsys.readouterr().err
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert main(["serve", "--chat-template", str(path)]) == 0
    assert started["chat_template"] == path.read_text()


def test_kv_cache_dtype_reaches_the_engine_without_a_warning(started, warnings):
    assert main(["serve", "--kv-cache-dtype", "bfloat16"]) == 0
    assert started["args"].kv_cache_dtype == "bfloat16" and not warnings
    assert main(["serve"]) == 0 and started["args"].kv_cache_dtype == "auto"


def test_mamba_cache_dtypes_reach_the_engine_without_a_warning(started, warnings):
    assert main(["serve", "--mamba-ssm-cache-dtype", "bfloat16", "--mamba-cache-dtype", "float32"]) == 0
    args = started["args"]
    assert (args.mamba_ssm_cache_dtype, args.mamba_cache_dtype) == ("bfloat16", "float32") and not warnings
    assert main(["serve"]) == 0 and started["args"].mamba_ssm_cache_dtype == "auto"


def test_vllm_api_key_env(started, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert main(["serve"]) == 0
    assert started["ns"].api_key == "from-env" and started["args"].model is None
    assert main(["serve", "--api-key", "flag"]) == 0
    assert started["ns"].api_key == "flag"
