"""`ascendserve bench serve|throughput|latency`: vLLM's `vllm bench` commands, flags and reports.

    ascendserve bench serve --base-url http://127.0.0.1:8000 --model demo --num-prompts 200 \
        --random-input-len 512 --random-output-len 128 --max-concurrency 16 --save-result --plot
    ascendserve bench throughput --model Qwen/Qwen3.5-0.8B --num-prompts 64 --min-len 32 --max-len 256
    ascendserve bench latency --batch-size 8 --input-len 128 --output-len 32
"""

import argparse
import asyncio
import os
import sys

from ascendserve.cli.engine_flags import (STARTUP_ERRORS, add_engine_flags, engine_args_from, json_object,
                                          non_negative_int, positive_float, positive_int)


# vLLM's `bench serve` sampling flags besides --temperature, sent only where given.
SAMPLING_FLAGS = {"--top-p": float, "--top-k": int, "--min-p": float, "--repetition-penalty": float}
_SAMPLING_KEYS = [flag[2:].replace("-", "_") for flag in SAMPLING_FLAGS]


def register(sub) -> None:
    """Add the `bench` subcommand and its serve/throughput/latency subcommands."""
    p = sub.add_parser("bench", help="benchmark a server (serve) or the offline engine (throughput, latency)",
                       description=__doc__.split("\n")[0])
    bench = p.add_subparsers(dest="bench_command", required=True)
    _add_serve(bench.add_parser("serve", help="online serving benchmark against any OpenAI-compatible server"))
    _add_throughput(bench.add_parser("throughput", help="offline throughput of LLM.generate"))
    _add_latency(bench.add_parser("latency", help="latency of one batch on the offline engine"))


def _add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--backend", default=None, choices=["openai", "openai-chat", "vllm"],
                   help="vLLM's name for the endpoint: openai/vllm = completions, openai-chat = chat")
    p.add_argument("--model", default=None, help="model name sent in requests (default: first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer directory or GGUF file for prompt lengths (default or 'none': the "
                        "server's /tokenize and /detokenize)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("VLLM_API_KEY"))
    p.add_argument("--dataset-name", "--dataset", default="random",
                   choices=["random", "sharegpt", "sharegpt-json", "prefix-repetition", "prefix_repetition"])
    p.add_argument("--dataset-path", default=None, help="a local ShareGPT JSON file")
    p.add_argument("--num-prompts", type=positive_int, default=1000)
    p.add_argument("--random-input-len", type=positive_int, default=1024)
    p.add_argument("--random-output-len", type=positive_int, default=128)
    p.add_argument("--random-range-ratio", type=_range_ratio, default=0.0)
    p.add_argument("--prefix-len", "--prefix-repetition-prefix-len", dest="prefix_len", type=non_negative_int,
                   default=256)
    p.add_argument("--num-prefixes", "--prefix-repetition-num-prefixes", dest="num_prefixes", type=positive_int,
                   default=10)
    p.add_argument("--sharegpt-output-len", type=positive_int, default=None)
    p.add_argument("--no-oversample", action="store_true",
                   help="a dataset with fewer usable entries than --num-prompts is an error, not drawn again")
    p.add_argument("--request-rate", type=positive_float, default=float("inf"),
                   help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=positive_float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    p.add_argument("--max-concurrency", type=positive_int, default=None)
    p.add_argument("--sweep-concurrency", default=None, help="comma-separated levels, e.g. 1,4,16,64: one run each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    for flag, kind in SAMPLING_FLAGS.items():
        p.add_argument(flag, type=kind, default=None, help="sent in every request where given (vLLM's sampling "
                       "parameters; the server checks them)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--extra-body", type=json_object, default=None,
                   help="a JSON object merged into every request body, e.g. for a server without ignore_eos: "
                        "'{\"min_tokens\": 128}'")
    p.add_argument("--percentile-metrics", type=_percentile_metrics, default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", type=_percentiles, default="99")
    p.add_argument("--goodput", nargs="+", type=_slo, default=None, metavar="KEY:MS",
                   help="SLOs for the request goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el; milliseconds)")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--plot", action="store_true", help="write a PNG chart next to the results")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run_serve)


def _range_ratio(value: str) -> float:
    """argparse type of --random-range-ratio: lengths vary by +-ratio, in [0, 1)."""
    try:
        ratio = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number is needed, got {value!r}") from None
    if not 0 <= ratio < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return ratio


def _percentile_metrics(value: str) -> str:
    """argparse type of --percentile-metrics: names from ttft, tpot, itl, e2el."""
    unknown = sorted({m.strip() for m in value.split(",")} - {"ttft", "tpot", "itl", "e2el"})
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown metric {unknown}; choose from ttft,tpot,itl,e2el")
    return value


def _slo(value: str) -> tuple[str, float]:
    """argparse type of one --goodput item: KEY:MS with KEY in ttft, tpot, e2el and MS >= 0."""
    key, _, number = value.partition(":")
    if key not in ("ttft", "tpot", "e2el"):
        raise argparse.ArgumentTypeError(f"KEY:MS with KEY one of ttft, tpot, e2el is needed, got {value!r}")
    try:
        ms = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of milliseconds after {key}: is needed, got {value!r}") from None
    if not ms >= 0:
        raise argparse.ArgumentTypeError(f"an SLO must be >= 0 ms, got {value!r}")
    return key, ms


def _percentiles(value: str) -> str:
    """argparse type of --metric-percentiles: numbers in (0, 100], comma-separated."""
    try:
        numbers = [float(v) for v in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated numbers like 50,90,99 are needed, got {value!r}") from None
    if not all(0 < n <= 100 for n in numbers):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100], got {value!r}")
    return value


def _add_offline_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, help="model path or repo id (default: the demo model)")
    p.add_argument("--model", default=None)
    add_engine_flags(p)
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=positive_int, default=128)
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=positive_int, default=128)
    p.add_argument("--n", type=positive_int, default=1, help="sequences generated per prompt (sampled)")
    p.add_argument("--disable-detokenize", action="store_true", help="time generation without detokenizing")
    p.add_argument("--dataset-name", default="random", choices=["random"],
                   help="vLLM's flag; the offline benchmarks generate random token prompts")
    p.add_argument("--backend", default="vllm", choices=["vllm"], help="vLLM's flag: this engine's offline LLM")
    p.add_argument("--output-json", default=None, help="write the results to this JSON file")


def _add_throughput(p: argparse.ArgumentParser) -> None:
    _add_offline_common(p)
    p.add_argument("--num-prompts", type=positive_int, default=1000)
    p.add_argument("--random-range-ratio", type=_range_ratio, default=0.0)
    p.add_argument("--min-len", type=positive_int, default=None, help="nano-vllm protocol: lengths uniform in [min, max]")
    p.add_argument("--max-len", type=positive_int, default=None)
    p.set_defaults(func=run_throughput)


def _add_latency(p: argparse.ArgumentParser) -> None:
    _add_offline_common(p)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--num-iters", type=positive_int, default=30)
    p.add_argument("--num-iters-warmup", type=non_negative_int, default=10)
    p.set_defaults(func=run_latency)


# -- bench serve ---------------------------------------------------------------------------------
def _serve_config(ns, concurrency: int | None):
    from ascendserve.bench.serve import ServeConfig
    return ServeConfig(base_url=ns.base_url, endpoint=ns.endpoint, model=ns.model, api_key=ns.api_key,
                       ignore_eos=ns.ignore_eos, max_concurrency=concurrency, request_rate=ns.request_rate,
                       burstiness=ns.burstiness, seed=ns.seed, temperature=ns.temperature,
                       sampling={name: value for name in _SAMPLING_KEYS if (value := getattr(ns, name)) is not None},
                       disable_tqdm=ns.disable_tqdm, extra_body=ns.extra_body)


def _concurrency_levels(ns) -> list[int | None]:
    if not ns.sweep_concurrency:
        return [ns.max_concurrency]
    if ns.max_concurrency is not None:  # it was dropped without a word: the sweep's levels are the concurrency
        raise ValueError("--max-concurrency and --sweep-concurrency are exclusive: the sweep's levels are the "
                         "concurrency of each run")
    try:
        levels = [int(v) for v in ns.sweep_concurrency.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep-concurrency takes integers like 1,4,16,64, got {ns.sweep_concurrency!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--sweep-concurrency levels must be >= 1, got {ns.sweep_concurrency!r}")
    return levels


def _result_name(ns, result: dict, sweep: bool) -> str:
    from ascendserve.bench.report import default_result_filename
    if not ns.result_filename:
        return default_result_filename(result)
    if not sweep:
        return ns.result_filename
    stem, ext = os.path.splitext(ns.result_filename)
    return f"{stem}-c{result['max_concurrency']}{ext or '.json'}"


def _check_dataset_path(ns) -> None:
    """A ShareGPT dataset needs --dataset-path naming a readable file (raises ValueError / OSError)."""
    if ns.dataset_name.replace("-", "_") not in ("sharegpt", "sharegpt_json"):
        return
    if not ns.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json (it is never downloaded)")
    with open(ns.dataset_path, "rb"):
        pass


def _check_server(ns) -> None:
    """vLLM's initial single-prompt test run: fail fast with the server's error."""
    from ascendserve.bench.datasets import SampleRequest
    from ascendserve.bench.serve import run_requests
    cfg = _serve_config(ns, 1)
    cfg.disable_tqdm = True
    # Not a benchmark prompt: the server must not have any of those in its prefix cache before the run.
    outputs, _ = asyncio.run(run_requests(cfg, [SampleRequest("Hello, my name is", 5, 4)]))
    if not outputs[0].success:
        raise RuntimeError(f"the initial test request failed: {outputs[0].error}")


def run_serve(ns) -> int:
    """Build the prompts, run once per concurrency level, print vLLM's report, save JSON and plots."""
    import httpx

    from ascendserve.bench.metrics import calculate_metrics
    from ascendserve.bench.report import format_report, result_json, save_result
    from ascendserve.bench.serve import first_model, make_codec, run_requests, sample_requests

    try:
        ns.base_url = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
        if ns.backend:
            ns.endpoint = "/v1/chat/completions" if ns.backend == "openai-chat" else "/v1/completions"
        levels = _concurrency_levels(ns)
        percentiles = [float(p) for p in ns.metric_percentiles.split(",")]
        shown = [m.strip() for m in ns.percentile_metrics.split(",")]
        _check_dataset_path(ns)  # before the server is asked anything: a wrong path is the user's to fix first
        ns.model = ns.model or first_model(ns.base_url, ns.api_key)
        _check_server(ns)
        codec = make_codec(ns.tokenizer, ns.base_url, ns.model, ns.api_key)
        print(f"Building {ns.num_prompts} {ns.dataset_name} prompts ...", flush=True)
        requests = sample_requests(ns, codec, ns.seed)
    except (ValueError, RuntimeError, OSError, httpx.HTTPError) as e:
        where = f" ({ns.base_url})" if isinstance(e, (RuntimeError, httpx.HTTPError)) else ""
        print(f"ascendserve bench serve: error: {type(e).__name__}: {e}{where}", file=sys.stderr)
        return 2
    results = []
    for i, level in enumerate(levels):
        if i:  # fresh prompts (seed + i), so no level finds the previous level's in the prefix cache
            requests = sample_requests(ns, codec, ns.seed + i)
        cfg = _serve_config(ns, level)
        print(f"Traffic request rate: {ns.request_rate}\nMaximum request concurrency: {level}", flush=True)
        outputs, duration = asyncio.run(run_requests(cfg, requests))
        metrics = calculate_metrics(outputs, duration, percentiles, dict(ns.goodput) if ns.goodput else None)
        print(format_report(metrics, level, ns.request_rate, percentiles, shown), flush=True)
        _report_failures(outputs)
        result = result_json(metrics, outputs, model_id=ns.model, endpoint=ns.endpoint, base_url=ns.base_url,
                             num_prompts=len(requests), request_rate=ns.request_rate, max_concurrency=level,
                             burstiness=ns.burstiness, tokenizer_id=ns.tokenizer, dataset=ns.dataset_name)
        results.append(result)
        if ns.save_result:
            print(f"Saved result to {save_result(result, ns.result_dir, _result_name(ns, result, len(levels) > 1))}")
    if ns.plot:
        try:
            _plot(ns, results)
        except RuntimeError as e:  # matplotlib missing: the results are saved already
            print(f"ascendserve bench serve: error: {e}", file=sys.stderr)
            return 2
    return 0 if all(r["completed"] for r in results) else 1


def _report_failures(outputs) -> None:
    """Name the first error when requests failed: an all-zero report alone (every request over the server's
    max_model_len, say) did not say why."""
    failed = [o for o in outputs if not o.success]
    if failed:
        print(f"ascendserve bench serve: {len(failed)} of {len(outputs)} requests failed; the first error: "
              f"{failed[0].error}", file=sys.stderr, flush=True)


def _plot(ns, results: list[dict]) -> None:
    from ascendserve.bench.plot import plot_requests, plot_sweep
    os.makedirs(ns.result_dir or ".", exist_ok=True)
    if len(results) > 1:
        stem = os.path.splitext(_result_name(ns, results[0], False))[0]
        name = "sweep-" + stem.replace(f"-concurrency{results[0]['max_concurrency']}", "") + ".png"
        path = plot_sweep(results, os.path.join(ns.result_dir or ".", name))
    else:
        name = os.path.splitext(_result_name(ns, results[0], False))[0] + ".png"
        path = plot_requests(results[0], os.path.join(ns.result_dir or ".", name))
    print(f"Saved plot to {path}")


# -- bench throughput / latency ------------------------------------------------------------------
def _llm(ns):
    """The offline LLM with the engine flags of the command line."""
    import dataclasses

    from ascendserve import LLM
    ns.model = ns.model or ns.model_tag
    args = engine_args_from(ns)
    return LLM(args.model, **{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name != "model"})


def _check_fit(llm, num_tokens: int) -> None:
    """vLLM's check: the longest request (prompt + output) fits max_model_len; it used to run with its output cut
    short, or stop with a traceback, and report numbers for fewer tokens than asked."""
    limit = llm.llm_engine.config.max_model_len
    if num_tokens > limit:
        raise ValueError(f"a request of {num_tokens} tokens (input + output length) does not fit max_model_len "
                         f"{limit}; lower --input-len / --output-len or raise --max-model-len")


def run_throughput(ns) -> int:
    """Generate random-token requests offline and print vLLM's throughput line."""
    from ascendserve.bench.throughput import format_throughput, run_throughput as run, save_json, throughput_dict
    from ascendserve.bench.throughput import workload
    try:
        workload(0, 1, ns.input_len, ns.output_len, ns.random_range_ratio, ns.min_len, ns.max_len)  # check flags
        llm = _llm(ns)
        prompts, out_lens = workload(ns.num_prompts, llm.llm_engine.vocab_size, ns.input_len, ns.output_len,
                                     ns.random_range_ratio, ns.min_len, ns.max_len, ns.seed)
        _check_fit(llm, max(len(p) + length for p, length in zip(prompts, out_lens)))
        result = run(llm, prompts, out_lens, ns.n, not ns.disable_detokenize)
    except STARTUP_ERRORS as e:
        print(f"ascendserve bench throughput: error: {e}", file=sys.stderr)
        return 2
    print(format_throughput(result))
    if ns.output_json:
        save_json(throughput_dict(result), ns.output_json)
    return 0


def run_latency(ns) -> int:
    """Time one batch `--num-iters` times and print vLLM's latency lines with the prefill/decode split."""
    from ascendserve.bench.latency import format_latency, latency_summary, run_latency as run
    from ascendserve.bench.throughput import save_json
    try:
        llm = _llm(ns)
        _check_fit(llm, ns.input_len + ns.output_len)
        timings = run(llm.llm_engine, ns.batch_size, ns.input_len, ns.output_len, ns.num_iters,
                      ns.num_iters_warmup, ns.seed, ns.n, not ns.disable_detokenize)
    except STARTUP_ERRORS as e:
        print(f"ascendserve bench latency: error: {e}", file=sys.stderr)
        return 2
    summary = latency_summary(timings)
    print(format_latency(summary, ns.batch_size))
    if ns.output_json:
        save_json(summary, ns.output_json)
    return 0
