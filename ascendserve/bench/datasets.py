"""Benchmark prompts: random (exact token lengths), prefix-repetition, and ShareGPT JSON files.

Lengths are counted with the target's own tokenizer: the server's `/tokenize` + `/detokenize` (vLLM,
ascendserve, llama.cpp's llama-server) or a local tokenizer (`--tokenizer` directory or GGUF file).
Counts exclude special tokens the server may add (BOS), as vLLM's `bench serve` counts them.
"""

import json
from dataclasses import dataclass

import numpy as np

from ascendserve.logger import init_logger

logger = init_logger(__name__)


@dataclass
class SampleRequest:
    """One benchmark prompt (vLLM's name): its text, its token count, and how many tokens to ask for."""

    prompt: str
    prompt_len: int
    expected_output_len: int


class LocalCodec:
    """Encode/decode with a local Hugging Face tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(ids)


class ServerCodec:
    """Encode/decode through a server's POST /tokenize and /detokenize.

    vLLM and ascendserve take {"model", "prompt"} and answer {"tokens"} / {"prompt"}; llama-server takes
    {"content"} and answers {"tokens"} / {"content"}. The first call picks the dialect.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 60) -> None:
        import httpx
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)
        self.model = model
        self.llama_cpp = False
        self._vocab_size: int | None = None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        if not self.llama_cpp:
            r = self.client.post("/tokenize", json={"model": self.model, "prompt": text, "add_special_tokens": False})
            if r.status_code == 200 and "tokens" in r.json():
                return r.json()["tokens"]
            self.llama_cpp = True
        r = self.client.post("/tokenize", json={"content": text, "add_special": False})
        if r.status_code != 200:
            raise RuntimeError(f"POST {self.client.base_url}/tokenize answered {r.status_code}: {r.text[:200]}; "
                               f"give a local tokenizer with --tokenizer PATH (a directory or a GGUF file)")
        return [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (raises httpx.HTTPStatusError for ids the server rejects)."""
        body = {"tokens": ids} if self.llama_cpp else {"model": self.model, "tokens": ids}
        r = self.client.post("/detokenize", json=body)
        r.raise_for_status()
        data = r.json()
        return data["content"] if "content" in data else data["prompt"]

    @property
    def vocab_size(self) -> int:
        """The number of ids /detokenize accepts, found by doubling then bisection (~40 small requests)."""
        if self._vocab_size is None:
            self.encode("a")  # pick the dialect
            lo, hi = 1, 1024  # invariant: id lo - 1 decodes; id hi - 1 may not
            while self._decodes(hi - 1) and hi < 2**24:
                lo, hi = hi, hi * 2
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self._decodes(mid - 1) else (lo, mid - 1)
            self._vocab_size = lo
        return self._vocab_size

    def _decodes(self, token_id: int) -> bool:
        try:
            self.decode([token_id])
            return True
        except Exception:  # noqa: BLE001 - any refusal (400, 500, bad JSON) means "not a valid id"
            return False


def load_local_tokenizer(path: str):
    """A Hugging Face tokenizer from a directory/repo id, or from a GGUF file's metadata."""
    if path.endswith(".gguf"):
        from ascendserve.loader.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def exact_length_text(codec, rng: np.random.Generator, num_tokens: int, prefix: str = "",
                      prefix_len: int = 0, max_retry: int = 20) -> tuple[str, int]:
    """Random text whose encoding (after `prefix`) is `prefix_len + num_tokens` tokens: (prompt, real length).

    Sample ids, decode, re-encode, then pad with fresh random ids or trim and repeat until the whole
    prompt re-encodes to the target length (vLLM's adjust loop). Decoding can merge or split tokens,
    e.g. ids [" hel", "lo"] -> " hello" -> one id, so a few rounds are usual. If `max_retry` rounds do
    not converge the real length is returned and reported.
    """
    target = prefix_len + num_tokens
    ids = rng.integers(0, codec.vocab_size, size=num_tokens).tolist()
    text, total = prefix, prefix_len
    for _ in range(max_retry):
        suffix = codec.decode(ids)
        text = prefix + suffix
        total = len(codec.encode(text))
        if total == target:
            break
        ids = codec.encode(suffix)
        if total < target:
            ids += rng.integers(0, codec.vocab_size, size=target - total).tolist()
        else:
            ids = ids[:max(len(ids) - (total - target), 0)]
    return text, total


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    """n lengths uniform in [mean * (1 - r), mean * (1 + r)] (vLLM's --random-range-ratio), at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return [max(1, int(v)) for v in rng.integers(low, high + 1, size=n)]


def random_requests(codec, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> list[SampleRequest]:
    """Prompts of random tokens with exact lengths, and their output lengths."""
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    requests = []
    for in_len, out_len in zip(in_lens, out_lens):
        text, real = exact_length_text(codec, rng, in_len)
        requests.append(SampleRequest(text, real, out_len))
    return requests


def prefix_repetition_requests(codec, num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, seed: int = 0) -> list[SampleRequest]:
    """`num_prefixes` shared prefixes of `prefix_len` tokens, each followed by `suffix_len` random tokens.

    Prompts cycle through the prefixes and are then shuffled (vLLM's prefix_repetition dataset).
    """
    if num_prefixes < 1:
        raise ValueError(f"--num-prefixes must be >= 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    prefixes = [exact_length_text(codec, rng, prefix_len) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        prefix, real_prefix_len = prefixes[i % num_prefixes]
        text, real = exact_length_text(codec, rng, suffix_len, prefix=prefix, prefix_len=real_prefix_len)
        requests.append(SampleRequest(text, real, output_len))
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


def _turns(entry) -> list[str]:
    """The turns' texts of one ShareGPT entry; none for an entry that is not a conversation object (skipped)."""
    if not isinstance(entry, dict):
        return []
    turns = entry.get("conversations") or entry.get("conversation") or entry.get("messages") or []
    return [t.get("value", t.get("content")) for t in turns if isinstance(t, dict)] if isinstance(turns, list) else []


def sharegpt_requests(path: str, codec, num_prompts: int, output_len: int | None = None,
                      seed: int = 0, oversample: bool = True) -> list[SampleRequest]:
    """The first human/assistant turn pair of ShareGPT entries read from a local JSON file.

    Entries are shuffled with `seed`; the assistant reply's length is the output length unless
    `output_len` fixes it. vLLM's filter applies: prompt and reply at least 4 tokens, prompt at most
    1024 and both together at most 2048. Fewer usable entries than `num_prompts` are drawn again at
    random to make up the number, as vLLM does, unless `oversample` is off (then it is an error).
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} entries")
    entries = [turns[:2] for turns in map(_turns, data)
               if len(turns) >= 2 and all(isinstance(t, str) for t in turns[:2])]
    rng = np.random.default_rng(seed)
    rng.shuffle(entries)
    requests = []
    for prompt, reply in entries:
        if len(requests) == num_prompts:
            break
        prompt_len = len(codec.encode(prompt))
        reply_len = output_len if output_len is not None else len(codec.encode(reply))
        if prompt_len < 4 or (output_len is None and reply_len < 4):
            continue
        if prompt_len > 1024 or prompt_len + reply_len > 2048:
            continue
        requests.append(SampleRequest(prompt, prompt_len, reply_len))
    if len(requests) < num_prompts and (not requests or not oversample):
        raise ValueError(f"{path}: only {len(requests)} usable conversations for --num-prompts {num_prompts}"
                         + ("" if requests else " (prompt and reply of 4+ tokens, at most 1024 + 2048 together)"))
    if len(requests) < num_prompts:
        logger.warning("%s: %d usable conversations; %d drawn again to make --num-prompts %d", path,
                       len(requests), num_prompts - len(requests), num_prompts)
        requests += [requests[i] for i in rng.integers(len(requests), size=num_prompts - len(requests))]
    return requests
