"""The streaming client against canned SSE answers, the offline workloads, latency phases, and the CLI."""

import asyncio
import json

import httpx
import pytest

from ascendserve.bench.datasets import SampleRequest
from ascendserve.bench.latency import IterationTiming, latency_summary, run_batch, run_latency
from ascendserve.bench.serve import ServeConfig, arrivals, request_body, send_request
from ascendserve.bench.throughput import workload
from ascendserve.cli.main import build_parser, main
from tests.server.utils import free_port


def _sse(*payloads) -> bytes:
    return b"".join(f"data: {json.dumps(p) if not isinstance(p, str) else p}\n\n".encode() for p in payloads)


def _send(body: bytes, endpoint: str = "/v1/completions", status: int = 200, piece: int = 0):
    """send_request against a canned answer; piece > 0 delivers the body in pieces of that many bytes."""
    seen = {}

    async def pieces():
        for i in range(0, len(body), piece):
            yield body[i:i + piece]

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content), auth=request.headers.get("authorization"))
        content = pieces() if piece else body
        return httpx.Response(status, content=content, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as client:
            cfg = ServeConfig("http://x", endpoint, "m", api_key="k", ignore_eos=True)
            return await send_request(client, cfg, SampleRequest("hi", 3, 4))

    return asyncio.run(go()), seen


def test_completions_stream_counts_usage_tokens():
    out, seen = _send(_sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                           {"choices": [{"text": "", "finish_reason": "length"}]},
                           {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}, "[DONE]"))
    assert out.success and out.output_len == 4 and out.num_chunks == 2 and len(out.itl) == 1
    assert out.generated_text == "ab" and out.server_prompt_tokens == 3 and out.prompt_len == 3
    assert 0 < out.ttft <= out.latency
    assert seen["prompt"] == "hi" and seen["stream"] and seen["stream_options"] == {"include_usage": True}
    assert seen["ignore_eos"] is True and seen["max_tokens"] == 4 and seen["auth"] == "Bearer k"


@pytest.mark.parametrize("piece", [1, 7, 64])
def test_events_split_anywhere_with_crlf_comments_and_no_final_newline(piece):
    # a chunk boundary may fall inside a line or between \r and \n; comments and other fields are skipped; the last
    # event needs no blank line after it
    events = [{"choices": [{"text": "h\u00e9"}]}, {"choices": [{"text": "llo"}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]
    body = b": keep-alive\r\n\r\n" + b"".join(f"event: message\r\ndata: {json.dumps(e)}\r\n\r\n".encode()
                                               for e in events[:2]) + f"data: {json.dumps(events[2])}".encode()
    out, _ = _send(body, piece=piece)
    assert out.success and out.generated_text == "h\u00e9llo" and out.num_chunks == 2 and out.output_len == 2


def test_nothing_after_done_is_read():
    out, _ = _send(_sse({"choices": [{"text": "a"}]}, "[DONE]") + b"data: {not json", piece=5)
    assert out.success and out.generated_text == "a" and not out.error


def test_chat_stream_without_usage_counts_chunks():
    out, seen = _send(_sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                           {"choices": [{"delta": {"reasoning_content": "r"}}]},
                           {"choices": [{"delta": {"content": "x"}}]},
                           {"choices": [{"delta": {"content": "y"}, "finish_reason": "stop"}]}, "[DONE]"),
                      endpoint="/v1/chat/completions")
    assert out.success and out.output_tokens is None and out.output_len == 3 and len(out.itl) == 2
    assert seen["messages"] == [{"role": "user", "content": "hi"}] and seen["max_completion_tokens"] == 4


def test_failed_requests_are_recorded():
    out, _ = _send(b'{"error": {"message": "busy"}}', status=503)
    assert not out.success and out.error.startswith("HTTP 503") and "busy" in out.error
    out, _ = _send(_sse({"error": {"message": "boom"}}))
    assert not out.success and "boom" in out.error
    # a stream the server ended with finish_reason abort (its shutdown) is a failure, not a short result
    out, _ = _send(_sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "", "finish_reason": "abort"}]}, "[DONE]"))
    assert not out.success and out.finish_reason == "abort" and "aborted by the server" in out.error
    out, _ = _send(_sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b", "finish_reason": "length"}]},
                        "[DONE]"))
    assert out.success and out.finish_reason == "length"


def test_request_body_without_ignore_eos():
    body = request_body(ServeConfig("u", "/v1/completions", "m"), SampleRequest("p", 1, 9))
    assert "ignore_eos" not in body and body["max_tokens"] == 9 and body["temperature"] == 0.0


def test_extra_body_is_merged_last():
    cfg = ServeConfig("u", "/v1/completions", "m", ignore_eos=True, extra_body={"min_tokens": 9, "temperature": 1})
    body = request_body(cfg, SampleRequest("p", 1, 9))
    assert body["min_tokens"] == 9 and body["temperature"] == 1 and body["ignore_eos"] is True


def test_sampling_flags_go_into_the_body_where_given():
    from ascendserve.cli.bench import _serve_config
    ns = build_parser().parse_args(["bench", "serve", "--top-k", "20", "--top-p", "0.95"])
    cfg = _serve_config(ns, None)
    assert cfg.sampling == {"top_p": 0.95, "top_k": 20}
    body = request_body(cfg, SampleRequest("p", 1, 9))
    assert (body["top_p"], body["top_k"]) == (0.95, 20) and "min_p" not in body and "repetition_penalty" not in body
    plain = request_body(_serve_config(build_parser().parse_args(["bench", "serve"]), None), SampleRequest("p", 1, 9))
    assert not {"top_p", "top_k", "min_p", "repetition_penalty"} & set(plain)


def test_poisson_arrivals_pace_requests():
    async def collect(rate):
        loop = asyncio.get_running_loop()
        start = loop.time()
        [i async for i in arrivals(5, rate, 1.0, seed=0)]
        return loop.time() - start

    assert asyncio.run(collect(float("inf"))) < 0.05
    assert asyncio.run(collect(200.0)) > 0.0


def test_throughput_workloads():
    prompts, outs = workload(16, vocab_size=100, input_len=0, output_len=0, min_len=32, max_len=256, seed=1)
    assert len(prompts) == len(outs) == 16
    assert all(32 <= len(p) <= 256 and 32 <= o <= 256 and max(p) < 100 for p, o in zip(prompts, outs))
    prompts, outs = workload(4, vocab_size=100, input_len=10, output_len=6)
    assert [len(p) for p in prompts] == [10] * 4 and outs == [6] * 4
    with pytest.raises(ValueError, match="--min-len"):
        workload(4, 100, 10, 6, min_len=8)


class _Out:
    def __init__(self, request_id, n_tokens):
        self.request_id = request_id
        self.outputs = [type("C", (), {"token_ids": [0] * n_tokens})()]


class FakeEngine:
    """Request "0" gets its first token at step 1, request "1" at step 2 (a chunked prefill); 4 steps in all."""

    vocab_size = 50

    def __init__(self):
        self.steps = 0
        self.added = []

    def next_request_id(self):
        return str(len(self.added))

    def add_request(self, request_id, prompt, params):
        assert params.ignore_eos and params.max_tokens == 3
        self.added.append(request_id)

    def has_unfinished_requests(self):
        return self.steps < 4

    def step(self):
        self.steps += 1
        return {1: [_Out("0", 1), _Out("1", 0)], 2: [_Out("0", 2), _Out("1", 1)]}.get(
            self.steps, [_Out("0", 3), _Out("1", 2)])


def test_latency_phases():
    timing = run_batch(FakeEngine(), [[1, 2], [3, 4]], output_len=3)
    assert timing.decode_steps == 2 and 0 < timing.prefill <= timing.latency
    summary = latency_summary([IterationTiming(0.54, 0.50, 2), IterationTiming(0.64, 0.60, 2)])
    assert summary["avg_latency"] == pytest.approx(0.59) and summary["avg_prefill_time"] == pytest.approx(0.55)
    assert summary["avg_decode_time_per_step"] == pytest.approx(0.02)
    assert summary["percentiles"]["50"] == pytest.approx(0.59)


def test_latency_batches_never_repeat_a_prompt():
    """Each warm-up and timed batch has prompts of its own: repeated ones were prefix-cache hits, so 'prefill' timed
    none (~9x too low with prefix caching on, the default)."""
    class Recorder:
        vocab_size = 50000

        def __init__(self):
            self.prompts, self.pending = [], []

        def next_request_id(self):
            return str(len(self.prompts))

        def add_request(self, request_id, prompt, params):
            self.prompts.append(tuple(prompt["prompt_token_ids"]))
            self.pending.append(request_id)

        def has_unfinished_requests(self):
            return bool(self.pending)

        def step(self):
            done, self.pending = self.pending, []
            return [_Out(r, 1) for r in done]

    engine = Recorder()
    run_latency(engine, batch_size=2, input_len=8, output_len=1, num_iters=3, num_iters_warmup=2)
    assert len(engine.prompts) == 10 and len(set(engine.prompts)) == 10


def test_cli_flags_parse():
    ns = build_parser().parse_args(["bench", "serve", "--dataset", "prefix-repetition", "--prefix-len", "8",
                                    "--num-prefixes", "2", "--sweep-concurrency", "1,4", "--request-rate", "2"])
    assert (ns.dataset_name, ns.prefix_len, ns.num_prefixes, ns.request_rate) == ("prefix-repetition", 8, 2, 2.0)
    assert build_parser().parse_args(["bench", "serve", "--extra-body", '{"a": [1]}']).extra_body == {"a": [1]}
    assert build_parser().parse_args(["bench", "serve", "--no-oversample"]).no_oversample
    ns = build_parser().parse_args(["bench", "serve", "--goodput", "ttft:500", "tpot:50.5"])
    assert dict(ns.goodput) == {"ttft": 500.0, "tpot": 50.5}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--extra-body", "[1]"])
    ns = build_parser().parse_args(["bench", "throughput", "--min-len", "32", "--max-len", "256",
                                    "--max-model-len", "512"])
    assert (ns.min_len, ns.max_len, ns.max_model_len, ns.num_prompts) == (32, 256, 512, 1000)
    ns = build_parser().parse_args(["bench", "latency", "--batch-size", "4", "--num-iters-warmup", "1"])
    assert (ns.batch_size, ns.num_iters_warmup, ns.num_iters) == (4, 1, 30)


@pytest.mark.parametrize("argv, message", [
    (["bench", "serve", "--request-rate", "-1"], "--request-rate: must be greater than 0"),
    (["bench", "serve", "--max-concurrency", "0"], "--max-concurrency: must be at least 1"),
    (["bench", "serve", "--num-prompts", "0"], "--num-prompts: must be at least 1"),
    (["bench", "serve", "--random-range-ratio", "1.5"], "--random-range-ratio: must be in [0, 1)"),
    (["bench", "serve", "--percentile-metrics", "ttft,foo"], "unknown metric ['foo']"),
    (["bench", "serve", "--metric-percentiles", "50,abc"], "--metric-percentiles: comma-separated numbers"),
    (["bench", "throughput", "--output-len", "0"], "--output-len/--random-output-len: must be at least 1"),
    (["generate", "x", "--max-tokens", "0"], "--max-tokens: must be at least 1"),
    (["bench", "serve", "--goodput", "itl:5"], "--goodput: KEY:MS with KEY one of ttft, tpot, e2el"),
    (["bench", "serve", "--goodput", "ttft:fast"], "--goodput: a number of milliseconds after ttft:"),
    (["bench", "serve", "--goodput", "ttft:-1"], "--goodput: an SLO must be >= 0 ms"),
    (["bench", "serve", "--sharegpt-output-len", "0"], "--sharegpt-output-len: must be at least 1"),
    (["bench", "serve", "--prefix-len", "-1"], "--prefix-len/--prefix-repetition-prefix-len: must be at least 0"),
    (["bench", "serve", "--num-prefixes", "0"], "--num-prefixes/--prefix-repetition-num-prefixes: must be at least 1"),
    (["bench", "latency", "--num-iters-warmup", "-1"], "--num-iters-warmup: must be at least 0"),
    (["bench", "throughput", "--random-range-ratio", "2"], "--random-range-ratio: must be in [0, 1)"),
    (["bench", "throughput", "--min-len", "0"], "--min-len: must be at least 1"),
])
def test_bad_cli_values_are_argparse_errors_naming_the_flag(argv, message, capsys):
    """Values that ran as 'unlimited', printed an all-zero report or ended in a traceback (numpy's 'scale < 0')."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert build_parser().parse_args(["bench", "serve", "--request-rate", "inf"]).request_rate == float("inf")


@pytest.mark.parametrize("flags, message", [(["--temperature", "-1"], "temperature must be a finite number >= 0"),
                                            (["--top-p", "0"], "top_p must be in (0, 1]")])
def test_generate_checks_sampling_flags_before_loading_the_model(flags, message, capsys, monkeypatch):
    """A bad --temperature used to surface only after the model had loaded (seconds to minutes), as a traceback."""
    import ascendserve.entrypoints.llm as llm_module

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the sampling flags were checked")

    monkeypatch.setattr(llm_module, "LLM", no_model)
    assert main(["generate", "x", *flags]) == 2
    assert f"ascendserve generate: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["generate", "x", "--kv-cache-dtype", "fp8"], "ascendserve generate: error: kv_cache_dtype 'fp8' is not supported"),
    (["generate", "x", "--model", "/no/such/model"], "ascendserve generate: error: Model '/no/such/model' was not found"),
    # an abbreviation is not taken (vLLM's --n was read as a prefix before bench throughput had its own --n)
    (["bench", "throughput", "--num-prompt", "2"], "unrecognized arguments: --num-prompt"),
])
def test_cli_errors_are_one_line(argv, message, capsys):
    """Engine errors in generate were tracebacks; abbreviated flags are not taken."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    ([], "ValueError: --dataset-name sharegpt needs --dataset-path FILE.json (it is never downloaded)"),
    (["--dataset-path", "x.json", "--max-concurrency", "4", "--sweep-concurrency", "1,2"],
     "ValueError: --max-concurrency and --sweep-concurrency are exclusive: the sweep's levels are the concurrency "
     "of each run"),
    (["--dataset-path", "/no/such/sharegpt.json"],
     "FileNotFoundError: [Errno 2] No such file or directory: '/no/such/sharegpt.json'"),
])
def test_bench_serve_checks_the_dataset_path_before_the_server(flags, message, capsys):
    """A missing ShareGPT file is named first (the port below has no server: the test request used to fail first,
    and the error named the server)."""
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m",
                 "--dataset-name", "sharegpt", *flags]) == 2
    assert capsys.readouterr().err.strip().endswith(f"ascendserve bench serve: error: {message}")


def test_bench_latency_refuses_requests_that_do_not_fit(capsys):
    """vLLM's check: input + output within max_model_len (it ran with the output cut to 5 of 32 tokens and reported
    those numbers)."""
    assert main(["bench", "latency", "--max-model-len", "256", "--input-len", "250", "--output-len", "32",
                 "--num-iters", "1", "--num-iters-warmup", "0"]) == 2
    assert "a request of 282 tokens (input + output length) does not fit max_model_len 256" in capsys.readouterr().err


def test_bench_throughput_takes_vllms_n_and_flag_names(tmp_path):
    """vLLM's --n (sequences per prompt), --random-input-len / --random-output-len, --dataset-name random,
    --backend vllm and --disable-detokenize (each an unrecognized or ambiguous flag before)."""
    out = tmp_path / "results" / "t.json"  # a directory that is not there yet is made (it was a traceback)
    assert main(["bench", "throughput", "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4",
                 "--n", "2", "--dataset-name", "random", "--backend", "vllm", "--disable-detokenize",
                 "--max-model-len", "256", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["num_requests"] == 2 and result["total_num_tokens"] == 2 * 8 + 2 * 2 * 4
