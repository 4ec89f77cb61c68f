"""Benchmark prompts: exact random lengths with a real tokenizer, prefix repetition, the ShareGPT reader."""

import json

import pytest

from ascendserve.bench.datasets import (LocalCodec, prefix_repetition_requests, random_requests,
                                        sharegpt_requests)
from tests.fixtures.qwen3_5_tokenizer import load_qwen3_5_tokenizer


@pytest.fixture(scope="module")
def codec() -> LocalCodec:
    return LocalCodec(load_qwen3_5_tokenizer())


class WordCodec:
    """One token per whitespace-separated word (ids are word indexes), for the file readers."""

    vocab_size = 1000

    def encode(self, text: str) -> list[int]:
        return [hash(w) % self.vocab_size for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


@pytest.mark.parametrize("input_len", [1, 7, 64, 300])
def test_random_prompts_have_exact_lengths(codec, input_len):
    requests = random_requests(codec, num_prompts=6, input_len=input_len, output_len=5, seed=input_len)
    for r in requests:
        assert r.prompt_len == input_len == len(codec.encode(r.prompt))
        assert r.expected_output_len == 5
    assert len({r.prompt for r in requests}) == 6


def test_random_range_ratio_and_seed(codec):
    requests = random_requests(codec, num_prompts=8, input_len=40, output_len=20, range_ratio=0.5, seed=3)
    assert all(20 <= r.prompt_len <= 60 and 10 <= r.expected_output_len <= 30 for r in requests)
    assert all(r.prompt_len == len(codec.encode(r.prompt)) for r in requests)
    assert len({r.prompt_len for r in requests}) > 1
    again = random_requests(codec, num_prompts=8, input_len=40, output_len=20, range_ratio=0.5, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in requests]
    with pytest.raises(ValueError, match="random-range-ratio"):
        random_requests(codec, 1, 4, 4, range_ratio=1.0)


def test_prefix_repetition(codec):
    requests = prefix_repetition_requests(codec, num_prompts=6, prefix_len=48, suffix_len=16, num_prefixes=2,
                                          output_len=7, seed=1)
    assert all(r.prompt_len == 64 == len(codec.encode(r.prompt)) and r.expected_output_len == 7 for r in requests)
    prefixes = {codec.decode(codec.encode(r.prompt)[:40]) for r in requests}
    assert len(prefixes) == 2


def test_sharegpt_reader(tmp_path):
    def conv(human_words: int, gpt_words: int) -> dict:
        return {"id": "x", "conversations": [{"from": "human", "value": " ".join(["q"] * human_words)},
                                             {"from": "gpt", "value": " ".join(["a"] * gpt_words)}]}

    data = [conv(5, 6), conv(2, 9), conv(8, 3), {"conversations": [{"from": "human", "value": "only one"}]},
            conv(1100, 5), conv(10, 12),
            {"messages": [{"role": "user", "content": "u u u u u"}, {"role": "assistant", "content": "b b b b"}]},
            "a plain string entry", {"conversations": "not a list"}, None]  # skipped (a plain string crashed the run)
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = sharegpt_requests(str(path), WordCodec(), num_prompts=3, seed=0)
    # The filter keeps (5, 6), (10, 12) and (5, 4): too-short prompts/replies and the 1100-word prompt go.
    assert sorted((r.prompt_len, r.expected_output_len) for r in requests) == [(5, 4), (5, 6), (10, 12)]
    fixed = sharegpt_requests(str(path), WordCodec(), num_prompts=4, output_len=2, seed=0)
    assert {r.expected_output_len for r in fixed} == {2} and len(fixed) == 4
    # Fewer usable entries than asked are drawn again (vLLM's oversampling); they used to be an error.
    more = sharegpt_requests(str(path), WordCodec(), num_prompts=7, seed=0)
    assert len(more) == 7 and {(r.prompt_len, r.expected_output_len) for r in more} == {(5, 4), (5, 6), (10, 12)}
    with pytest.raises(ValueError, match="only 3 usable"):
        sharegpt_requests(str(path), WordCodec(), num_prompts=5, oversample=False)
    path.write_text(json.dumps([conv(1, 1)]))
    with pytest.raises(ValueError, match="only 0 usable"):
        sharegpt_requests(str(path), WordCodec(), num_prompts=1)
