"""SamplingParams: vLLM's defaults, one named error per bad field, and the normalizations."""

import subprocess
import sys

import pytest

from ascendserve.engine.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_torch_free():
    code = "import sys, ascendserve.engine.sampling_params; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_defaults_equal_vllm():
    p = SamplingParams()
    assert (p.n, p.presence_penalty, p.frequency_penalty) == (1, 0.0, 0.0)
    assert p.repetition_penalty == 1.0
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == ([], [], False)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert (p.detokenize, p.skip_special_tokens, p.spaces_between_special_tokens) == (True,) * 3
    assert p.include_stop_str_in_output is False
    assert (p.logit_bias, p.allowed_token_ids) == (None, None)
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy
    assert p.all_stop_token_ids == set()


@pytest.mark.parametrize("kwargs, field", [
    ({"n": 0}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 1.1}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -2}, "logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
    ({"stop": ["a", ""]}, "stop"),
    ({"stop": "a", "detokenize": False}, "stop"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"temperature": 0.0, "n": 2}, "n"),
    ({"temperature": 1.0, "n": 16385}, "n"),  # VLLM_MAX_N_SEQUENCES
])
def test_validation_error_names_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(field), str(info.value)


def test_error_messages_give_range_and_value():
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0, got -1.0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match=r"n must be at least 1, got 0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match=r"min_tokens must be less than or equal to max_tokens=4"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_accepted_edges():
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, min_p=1.0, top_p=1.0)
    SamplingParams(max_tokens=None, min_tokens=1000)
    assert SamplingParams(logprobs=-1).logprobs == -1
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(seed=-1).seed is None


def test_greedy_normalization():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and p.sampling_type is SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy


def test_tiny_positive_temperature_is_raised():
    assert SamplingParams(temperature=1e-3).temperature == 1e-2


def test_seeded_sampling_type():
    assert SamplingParams(seed=7).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(seed=7, temperature=0).sampling_type is SamplingType.GREEDY


def test_stop_normalization():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop=["abc", "de"]).output_text_buffer_length == 2
    kept = SamplingParams(stop=["abc"], include_stop_str_in_output=True)
    assert kept.output_text_buffer_length == 0
    p = SamplingParams(stop_token_ids=(5, 7, 5))
    assert p.stop_token_ids == [5, 7, 5] and p.all_stop_token_ids == {5, 7}


def test_logit_bias_keys_converted_and_clamped():
    p = SamplingParams(logit_bias={"3": 1.5, 4: -200})
    assert p.logit_bias == {3: 1.5, 4: -100.0}


def test_validate_against_vocab():
    ok = SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[0, 9], stop_token_ids=[9])
    ok.validate_against(10)
    for kwargs, field in [({"logit_bias": {10: 1.0}}, "logit_bias"),
                          ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
                          ({"stop_token_ids": [12]}, "stop_token_ids"),
                          ({"logprobs": 11}, "logprobs")]:
        with pytest.raises(ValueError, match=rf"^{field}.*\b(9|10)\b"):
            SamplingParams(**kwargs).validate_against(10)
    SamplingParams(logprobs=-1).validate_against(10, max_logprobs=10)  # -1: the whole vocabulary, 10 here
    SamplingParams(logprobs=10).validate_against(10, max_logprobs=-1)  # -1: no cap
    for logprobs in (6, -1):
        with pytest.raises(ValueError, match=r"^logprobs: requested (6|-1 \(the whole vocabulary: 10\)) .* at most 5"):
            SamplingParams(logprobs=logprobs).validate_against(10, max_logprobs=5)


def test_clone_is_independent():
    p = SamplingParams(stop=["x"], logit_bias={1: 2.0}, seed=3)
    q = p.clone()
    q.stop.append("y")
    q.logit_bias[2] = 1.0
    assert p.stop == ["x"] and p.logit_bias == {1: 2.0} and q.seed == 3
    assert q == SamplingParams(stop=["x", "y"], logit_bias={1: 2.0, 2: 1.0}, seed=3)


def test_repr_is_readable():
    text = repr(SamplingParams(temperature=0.5, stop="s"))
    assert text.startswith("SamplingParams(n=1, ")
    assert "temperature=0.5" in text and "stop=['s']" in text
