"""LLM.beam_search (vLLM's) against the same search run on transformers' logits of a tiny random Llama."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from ascendserve import LLM
from ascendserve.engine.beam_search import BeamSearchParams
from tests.models.llama_tiny import build_llama

EOS = 2  # LlamaConfig's eos_token_id


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, prompts, _ = build_llama(tmp_path_factory.mktemp("llama"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_gpu_blocks_override=256, max_model_len=512)
    return llm, model, [prompts[1], prompts[3], prompts[4]]


def _score(tokens: list[int], cum: float, penalty: float) -> float:
    return cum / ((len(tokens) - (tokens[-1] == EOS)) ** penalty)


@torch.no_grad()
def reference(model, prompt: list[int], width: int, max_tokens: int, penalty: float, eos: set[int]):
    """The beams of vLLM's algorithm from transformers' next-token log-softmax: the top 2 x width tokens of each live
    beam extend it, EOS completes it, the best `width` live ones go on; completed and live ranked at the end."""
    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            logprobs = model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            top = logprobs.topk(2 * width)
            for token, value in zip(top.indices.tolist(), top.values.tolist()):
                (done if token in eos else candidates).append((tokens + [token], cum + value))
        live = sorted(candidates, key=lambda b: _score(*b, penalty), reverse=True)[:width]
    return sorted(done + live, key=lambda b: _score(*b, penalty), reverse=True)[:width]


@pytest.mark.parametrize("width, max_tokens, penalty, eos_is_likely", [(1, 5, 1.0, False), (3, 4, 1.0, False),
                                                                        (4, 3, 0.5, False), (3, 4, 1.0, True)])
def test_beams_match_transformers(tiny, width, max_tokens, penalty, eos_is_likely, monkeypatch):
    llm, model, prompts = tiny
    if eos_is_likely:  # a token the beams meet early stands for EOS, so that beams complete
        with torch.no_grad():
            likely = model(torch.tensor([prompts[0]])).logits[0, -1].argsort(descending=True)[1].item()
        monkeypatch.setattr(llm.llm_engine, "eos_token_ids", frozenset({EOS, likely}))
    eos = set(llm.llm_engine.eos_token_ids)
    assert EOS in eos
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                              BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty))
    for prompt, out in zip(prompts, outputs):
        expected = reference(model, prompt, width, max_tokens, penalty, eos)
        assert [b.tokens for b in out.sequences] == [tokens for tokens, _ in expected]
        for beam, (_, cum) in zip(out.sequences, expected):
            assert math.isclose(beam.cum_logprob, cum, abs_tol=1e-3)
            assert beam.tokens[:len(prompt)] == prompt and len(beam.logprobs) == len(beam.tokens) - len(prompt)
            assert beam.finish_reason == ("stop" if beam.tokens[-1] in eos else "length")
    if eos_is_likely:
        assert any(b.finish_reason == "stop" for out in outputs for b in out.sequences)
    pool = llm.llm_engine.kv_cache_manager.pool
    assert pool.counts()[2] == 0  # no block left in use


def test_beam_search_errors(tiny):
    llm = tiny[0]
    with pytest.raises(ValueError, match="beam_width 11 ranks 2 x 11 = 22 logprobs a step, but max_logprobs is 20"):
        llm.beam_search([{"prompt_token_ids": [1, 2]}], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=2)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(["x"], {"beam_width": 2})


def test_text_options_without_a_tokenizer_are_refused(tiny):
    """stop strings and bad_words need text: with skip_tokenizer_init they are errors (stop strings were accepted and
    could never match)."""
    from ascendserve import SamplingParams
    llm = tiny[0]
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, bad_words=["x"]), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
