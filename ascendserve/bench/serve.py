"""`bench serve`'s client: stream requests to any OpenAI-compatible server and time every token chunk.

Requests stream (`stream: true`, `stream_options.include_usage`), so the same client measures vLLM,
llama-server, transformers serve and ascendserve. One httpx connection pool; at most
`max_concurrency` requests in flight (a semaphore); arrivals are all at once (request_rate inf) or a
gamma process (burstiness 1 = Poisson) with the given mean rate.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from ascendserve.bench.datasets import SampleRequest
from ascendserve.bench.metrics import RequestFuncOutput

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


@dataclass
class ServeConfig:
    """Where and how to send the requests of one run."""

    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    seed: int = 0
    temperature: float = 0.0
    sampling: dict | None = None  # top_p, top_k, min_p, repetition_penalty where given (vLLM's sampling flags)
    disable_tqdm: bool = False
    timeout_s: float = 6 * 3600
    extra_body: dict | None = None  # merged into every request body last (vLLM's --extra-body)


def request_body(cfg: ServeConfig, req: SampleRequest) -> dict:
    """The JSON body for one prompt: completions take `prompt`, chat takes one user message; then the sampling flags
    given, then `extra_body`."""
    body = {"model": cfg.model, "max_tokens": req.expected_output_len, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.expected_output_len
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.sampling or {})
    body.update(cfg.extra_body or {})
    return body


def _chunk_text(choice: dict) -> str:
    """The new text of one streamed choice (completions `text`, chat `content` or reasoning)."""
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
    if not text and delta.get("tool_calls"):
        text = json.dumps(delta["tool_calls"])
    return text


async def _sse_data(response) -> AsyncIterator[dict]:
    """The JSON payloads of a server-sent-events stream, until `[DONE]`."""
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def send_request(client, cfg: ServeConfig, req: SampleRequest) -> RequestFuncOutput:
    """Send one streaming request; every chunk carrying new text is one token event (TTFT, then ITLs)."""
    out = RequestFuncOutput(prompt_len=req.prompt_len)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    start = out.start_time = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", cfg.endpoint, json=request_body(cfg, req), headers=headers) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:500]}"
                return out
            async for data in _sse_data(response):
                if data.get("error"):
                    out.error = json.dumps(data["error"])[:500]
                    return out
                if usage := data.get("usage"):
                    out.output_tokens = usage.get("completion_tokens", out.output_tokens)
                    out.server_prompt_tokens = usage.get("prompt_tokens")
                choices = data.get("choices") or []
                out.finish_reason = next((c["finish_reason"] for c in choices if c.get("finish_reason")),
                                         out.finish_reason)
                text = "".join(_chunk_text(c) for c in choices)
                if not text:
                    continue
                now = time.perf_counter()
                if out.num_chunks == 0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
                out.num_chunks += 1
                out.generated_text += text
        out.latency = time.perf_counter() - start
        out.success = (out.num_chunks > 0 or out.output_tokens is not None) and out.finish_reason != "abort"
        if out.num_chunks == 0:  # only tokens with no text (an immediate EOS): the first token came at the end
            out.ttft = out.latency
        if out.finish_reason == "abort":  # the server gave up on it (shutting down, say): a failure, not a result
            out.error = "aborted by the server (finish_reason abort)"
        elif not out.success:
            out.error = "the stream ended without any generated text"
    except Exception as e:  # noqa: BLE001 - a failed request is counted, never fatal to the run
        out.error = f"{type(e).__name__}: {e}"
    return out


async def arrivals(n: int, request_rate: float, burstiness: float, seed: int) -> AsyncIterator[int]:
    """Yield 0..n-1, sleeping gamma-distributed gaps of mean 1/request_rate between them (none when inf)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if request_rate == float("inf") or i == n - 1:
            continue
        theta = 1.0 / (request_rate * burstiness)
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))


async def run_requests(cfg: ServeConfig, requests: list[SampleRequest]) -> tuple[list[RequestFuncOutput], float]:
    """Send every request (bounded by max_concurrency, paced by request_rate): (outputs in order, duration s)."""
    import httpx

    limit = cfg.max_concurrency or len(requests) or 1
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    semaphore = asyncio.Semaphore(limit)
    bar = tqdm(total=len(requests), disable=cfg.disable_tqdm)

    async def one(client, req):
        async with semaphore:
            out = await send_request(client, cfg, req)
        bar.update(1)
        return out

    async with httpx.AsyncClient(base_url=cfg.base_url, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s, connect=30)) as client:
        start = time.perf_counter()
        tasks = []
        async for i in arrivals(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed):
            tasks.append(asyncio.create_task(one(client, requests[i])))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(outputs), duration


def first_model(base_url: str, api_key: str | None = None) -> str:
    """The first id of GET /v1/models (vLLM's bench does the same when --model is not given)."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def make_codec(tokenizer: str | None, base_url: str, model: str, api_key: str | None):
    """A local tokenizer when --tokenizer names one, else the server's /tokenize and /detokenize."""
    from ascendserve.bench.datasets import LocalCodec, ServerCodec, load_local_tokenizer
    if tokenizer and tokenizer.lower() != "none":
        return LocalCodec(load_local_tokenizer(tokenizer))
    return ServerCodec(base_url, model, api_key)


def sample_requests(ns, codec, seed: int) -> list[SampleRequest]:
    """The prompts of `--dataset-name` (random, sharegpt, prefix_repetition)."""
    from ascendserve.bench import datasets
    name = ns.dataset_name.replace("-", "_")
    if name == "random":
        return datasets.random_requests(codec, ns.num_prompts, ns.random_input_len, ns.random_output_len,
                                        ns.random_range_ratio, seed)
    if name == "prefix_repetition":
        return datasets.prefix_repetition_requests(codec, ns.num_prompts, ns.prefix_len, ns.random_input_len,
                                                   ns.num_prefixes, ns.random_output_len, seed)
    if name in ("sharegpt", "sharegpt_json"):
        if not ns.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json (it is never downloaded)")
        return datasets.sharegpt_requests(ns.dataset_path, codec, ns.num_prompts, ns.sharegpt_output_len, seed,
                                          oversample=not ns.no_oversample)
    raise ValueError(f"unknown --dataset-name {ns.dataset_name!r}")
