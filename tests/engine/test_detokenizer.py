"""Incremental detokenization and stop strings, on small tokenizers trained inside the test."""

import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ascendserve.engine.detokenizer import IncrementalDetokenizer, decode_token

CORPUS = [
    "Hello world, this is a test. The quick brown fox jumps over the lazy dog.",
    "你好，世界！我们今天学习中文。",
    "I love emoji 😀🎉 and more emoji 🚀✨ every day.",
    "café naïve résumé — déjà vu, Ångström, São Paulo.",
]
TEXTS = [
    "Hello world, this is a test.",
    "你好，世界！Hello 世界",
    "Emoji time 😀🎉 done 🚀",
    "café naïve résumé — déjà vu, mañana",
    "mixed 你好😀é end",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 / Qwen style) with a vocabulary small enough to split characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                 eos_token="<|im_end|>",
                                 additional_special_tokens=["<|endoftext|>"])
    hf.add_tokens(["<tool_call>"])  # an added token that is not special
    return hf


@pytest.fixture(scope="module")
def spiece_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style (Metaspace) BPE, whose `decode` drops the first token's space."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["</s>"])
    tok.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer) -> list[int]:
    return encode(tokenizer, "<|im_start|>user\nSay hi 😀<|im_end|>\n<|im_start|>assistant\n")


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> str | None:
    """Feed ids one at a time, as the engine does, until a stop string matches; return it."""
    for token_id in ids:
        if (stop_str := detok.update([token_id])) is not None:
            return stop_str
    return None


def check_incremental(tokenizer, prompt: list[int], gen: list[int], skip: bool) -> None:
    """After each token, the text equals a full decode of the tokens so far, up to whole chars."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    complete = ""  # the decode of the longest token prefix that ends on a whole character
    for k, token_id in enumerate(gen, start=1):
        assert detok.update([token_id]) is None
        full = tokenizer.decode(gen[:k], skip_special_tokens=skip)
        complete = complete if full.endswith(FFFD) else full
        assert detok.output_text == complete
        assert FFFD not in detok.output_text
    assert detok.output_text == tokenizer.decode(gen, skip_special_tokens=skip)
    assert detok.token_ids == gen


def test_fixture_splits_multibyte_characters(tokenizer):
    for text in ("你好，世界", "😀🎉", "ñ"):
        pieces = [tokenizer.decode([i]) for i in encode(tokenizer, text)]
        assert any(FFFD in p for p in pieces), (text, pieces)
    assert tokenizer.decode(encode(tokenizer, "😀🎉")) == "😀🎉"


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_matches_full_decode(tokenizer, text, skip):
    check_incremental(tokenizer, prompt_ids(tokenizer), encode(tokenizer, text), skip)


def test_incremental_with_empty_prompt_and_special_tokens(tokenizer):
    gen = encode(tokenizer, "你好<|im_end|>😀<tool_call>x<|endoftext|>é")
    for skip in (True, False):
        check_incremental(tokenizer, [], gen, skip)


def test_batched_update_equals_single_token_updates(tokenizer):
    gen = encode(tokenizer, TEXTS[4])
    for chunk in (2, 3, len(gen)):
        detok = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer))
        for start in range(0, len(gen), chunk):
            detok.update(gen[start:start + chunk])
        assert detok.output_text == TEXTS[4]


def test_first_token_leading_space_comes_from_prompt_context(spiece_tokenizer):
    tok = spiece_tokenizer
    ids = encode(tok, "Hello world, this is a test.")
    split = next(k for k in range(1, len(ids)) if tok.convert_ids_to_tokens(ids[k])[0] == "\u2581")
    prompt, gen = ids[:split], ids[split:]
    expected = tok.decode(ids)[len(tok.decode(prompt)):]
    assert expected.startswith(" ") and not tok.decode(gen).startswith(" ")
    detok = IncrementalDetokenizer(tok, prompt)
    stream(detok, gen)
    assert detok.output_text == expected


@pytest.mark.parametrize("stop", [(), ("world!",), ("zzzzzzzz", "q")])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_output_text(tokenizer, text, stop):
    gen = encode(tokenizer, text)
    streamed = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), stop=stop)
    cumulative = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), stop=stop)
    sent = ""
    for k, token_id in enumerate(gen, start=1):
        finished = k == len(gen)
        streamed.update([token_id])
        cumulative.update([token_id])
        sent += streamed.get_next_output_text(finished, delta=True)
        held = streamed.stop_buffer_length if not finished else 0
        assert sent == streamed.output_text[:max(len(streamed.output_text) - held, 0)]
        assert cumulative.get_next_output_text(finished, delta=False) == sent
    assert sent == streamed.output_text == text
    assert streamed.get_next_output_text(finished=True, delta=True) == ""


def test_hold_back_never_streams_a_forming_stop_string(tokenizer):
    # "world" is a prefix of the stop string "world!", which never completes ("world," follows).
    text = "Hello world, this is a test."
    detok = IncrementalDetokenizer(tokenizer, [], stop=["world!"])
    sent = ""
    for token_id in encode(tokenizer, text):
        assert detok.update([token_id]) is None
        sent += detok.get_next_output_text(finished=False, delta=True)
        if detok.output_text.endswith("world"):
            assert "w" not in sent
    assert "world" in sent  # released once it could no longer be a stop string
    sent += detok.get_next_output_text(finished=True, delta=True)
    assert sent == text


def spans_token_boundary(tokenizer, ids: list[int], start: int, end: int) -> bool:
    """Whether text[start:end] crosses a boundary between two tokens (ASCII text only)."""
    cuts = {len(tokenizer.decode(ids[:k])) for k in range(1, len(ids))}
    return any(start < cut < end for cut in cuts)


def run_stop(tokenizer, text: str, stop: list[str], include: bool = False,
             batched: bool = False) -> tuple[str | None, str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), stop=stop,
                                   include_stop_str_in_output=include)
    gen = encode(tokenizer, text)
    matched = detok.update(gen) if batched else stream(detok, gen)
    return matched, detok.output_text


@pytest.mark.parametrize("batched", [False, True])
def test_stop_string_spanning_token_boundary(tokenizer, batched):
    text = "Hello world, this is a test."
    start = text.index("o wor")
    assert spans_token_boundary(tokenizer, encode(tokenizer, text), start, start + len("o wor"))
    assert run_stop(tokenizer, text, ["o wor"], batched=batched) == ("o wor", "Hell")
    assert run_stop(tokenizer, text, ["o wor"], include=True, batched=batched) == \
        ("o wor", "Hello wor")


def test_stop_string_made_of_split_multibyte_characters(tokenizer):
    assert run_stop(tokenizer, "你好，世界！Hello", ["世界"]) == ("世界", "你好，")
    assert run_stop(tokenizer, "Emoji time 😀🎉 done", ["🎉"], include=True) == \
        ("🎉", "Emoji time 😀🎉")


@pytest.mark.parametrize("batched", [False, True])
def test_earliest_stop_string_wins(tokenizer, batched):
    text = "Hello world, this is a test."
    assert run_stop(tokenizer, text, ["a test", "this", "zebra"], batched=batched) == \
        ("this", "Hello world, ")
    # Overlapping matches: the one that ends first wins, however the tokens were batched.
    assert run_stop(tokenizer, text, ["world, this", "ld"], batched=batched) == ("ld", "Hello wor")


def test_stop_string_at_the_very_start(tokenizer):
    text = "Hello world, this is a test."
    assert run_stop(tokenizer, text, ["Hel"]) == ("Hel", "")
    assert run_stop(tokenizer, text, ["Hel"], include=True) == ("Hel", "Hel")


def test_stop_string_not_found(tokenizer):
    assert run_stop(tokenizer, "Hello world", ["worlds"]) == (None, "Hello world")


@pytest.mark.parametrize("batched", [False, True])
def test_stop_string_ignored_within_min_tokens(tokenizer, batched):
    text = "Hello world, this is a test."
    detok = IncrementalDetokenizer(tokenizer, [], stop=["Hel", "is"], min_tokens=2)
    gen = encode(tokenizer, text)
    assert len("Hel") <= len(tokenizer.decode(gen[:2])) < text.index("is")
    matched = detok.update(gen) if batched else stream(detok, gen)
    assert (matched, detok.output_text) == ("is", "Hello world, th")


def test_empty_stop_string_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="empty string"):
        IncrementalDetokenizer(tokenizer, [], stop=["ok", ""])


@pytest.mark.parametrize("skip", [True, False])
def test_stop_terminated_token_text_is_not_in_output(tokenizer, skip):
    gen = encode(tokenizer, "Hi 你好") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids(tokenizer), skip_special_tokens=skip)
    stream(detok, gen[:-1])
    assert detok.update(gen[-1:], stop_terminated=True) is None
    assert detok.output_text == "Hi 你好"
    assert detok.token_ids == gen
    assert detok.get_next_output_text(finished=True, delta=False) == "Hi 你好"


def test_stop_terminated_with_include_stop_str_in_output(tokenizer):
    # As vLLM: include_stop_str_in_output also keeps the text of a stop token (if not skipped).
    gen = encode(tokenizer, "Hi") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False,
                                   include_stop_str_in_output=True)
    detok.update(gen, stop_terminated=True)
    assert detok.output_text == "Hi<|im_end|>"


def test_skip_special_tokens(tokenizer):
    gen = encode(tokenizer, "a<|im_end|>b<tool_call>c<|endoftext|>")
    assert len(gen) == 6
    shown = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    hidden = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    stream(shown, gen)
    stream(hidden, gen)
    assert shown.output_text == "a<|im_end|>b<tool_call>c<|endoftext|>"
    assert hidden.output_text == "ab<tool_call>c"


class SlowTokenizer:
    """A minimal slow (non-`is_fast`) tokenizer: added tokens must be joined in by hand."""

    is_fast = False
    all_special_ids = [0]
    vocab = ["<s>", "<tool>", "a", "b"]

    def get_added_vocab(self) -> dict[str, int]:
        return {"<s>": 0, "<tool>": 1}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.vocab[token_id]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)


@pytest.mark.parametrize("spaces, expected", [(True, "a <tool> b"), (False, "a<tool>b")])
def test_spaces_between_special_tokens_with_slow_tokenizer(spaces, expected):
    detok = IncrementalDetokenizer(SlowTokenizer(), [0], spaces_between_special_tokens=spaces)
    stream(detok, [2, 0, 1, 3])
    assert detok.output_text == expected


def test_decode_token(tokenizer, spiece_tokenizer):
    hello, space = encode(tokenizer, "Hello "), tokenizer.convert_tokens_to_ids("\u0120")
    assert "".join(decode_token(tokenizer, i) for i in hello) == "Hello "
    assert decode_token(tokenizer, space) == " "
    assert decode_token(tokenizer, tokenizer.eos_token_id) == "<|im_end|>"
    assert FFFD in decode_token(tokenizer, encode(tokenizer, "😀")[0])
    first = encode(spiece_tokenizer, "Hello world")[0]
    piece = spiece_tokenizer.convert_ids_to_tokens(first)
    assert piece.startswith("\u2581") and not spiece_tokenizer.decode([first]).startswith(" ")
    assert decode_token(spiece_tokenizer, first) == piece.replace("\u2581", " ")


def demo_gguf_path() -> Path:
    root = os.environ.get("ASCENDSERVE_CACHE_DIR", "~/.cache/ascendserve")
    return Path(root).expanduser() / "demo" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(not demo_gguf_path().exists(), reason="demo GGUF not downloaded")
def test_incremental_matches_full_decode_with_demo_gguf_tokenizer():
    path = demo_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = encode(tok, chat)
    for text in TEXTS:
        for skip in (True, False):
            check_incremental(tok, prompt, encode(tok, text), skip)
