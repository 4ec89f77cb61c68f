"""Incremental detokenization and stop-string checks for one generated sequence (no torch)."""

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How many prompt tokens are decoded as context before the first generated token, so that its
# leading space comes out as in a full decode (vLLM's value: "bigger = more conservative").
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5

# What a decoder writes for bytes that are not (yet) a complete UTF-8 character.
_REPLACEMENT_CHAR = "\ufffd"
# SentencePiece's word-boundary marker; `decode` strips it from the first token of a text.
_SPIECE_UNDERLINE = "\u2581"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, never emitting a broken UTF-8 character."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 min_tokens: int = 0) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop cannot contain an empty string, got {list(stop)!r}.")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        # Stop strings only count once they end in the text of a token after the first min_tokens.
        self.min_tokens = min_tokens
        # Characters held back from streaming so that a forming stop string is never sent.
        self.stop_buffer_length = (max(len(s) for s in self.stop) - 1
                                   if self.stop and not include_stop_str_in_output else 0)
        self.token_ids: list[int] = []
        self.output_text = ""
        self._last_output_text_offset = 0
        self._special_ids = (frozenset(tokenizer.all_special_ids) if skip_special_tokens
                             else frozenset())
        # Slow tokenizers cannot turn added tokens into text; those are joined in by hand.
        self._added_vocab = (frozenset(tokenizer.get_added_vocab())
                             if not getattr(tokenizer, "is_fast", True) else frozenset())
        self._init_window(prompt_token_ids)

    def _init_window(self, prompt_token_ids: Sequence[int]) -> None:
        # Invariant: _tokens[_prefix_offset:_read_offset] is text already emitted (or prompt
        # context), and _tokens[_read_offset:] is what is not emitted yet. Only this window is
        # kept: each step decodes a few tokens, never the whole sequence.
        # E.g. prompt [..., p3..p9] -> _tokens = [p3..p9], _prefix_offset = 2, _read_offset = 7.
        ids = list(prompt_token_ids[-(INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2):])
        self._tokens = [t for t in map(self._id_to_token, ids) if t is not None]
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append generated tokens; return the stop string matched (text truncated) or None."""
        new_token_ids = list(new_token_ids)
        # As vLLM: a stop token / EOS that ended the sequence is recorded but not detokenized,
        # unless include_stop_str_in_output asks for it.
        skipped_stop_token_id = None
        if new_token_ids and stop_terminated and not self.include_stop_str_in_output:
            skipped_stop_token_id = new_token_ids.pop()
        stop_check_offset = len(self.output_text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.output_text += self._decode_next(token_id)
            if len(self.token_ids) <= self.min_tokens:
                stop_check_offset = len(self.output_text)
        if skipped_stop_token_id is not None:
            self.token_ids.append(skipped_stop_token_id)
        return self._check_stop_strings(stop_check_offset)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to send now: all so far, or (delta) only the unsent part, minus the stop buffer."""
        # While running, the last stop_buffer_length chars may be the start of a stop string.
        buffer_length = 0 if finished else self.stop_buffer_length
        length = max(len(self.output_text) - buffer_length, 0)
        if not delta:
            return self.output_text[:length]
        last_offset = self._last_output_text_offset
        if length <= last_offset:
            return ""
        self._last_output_text_offset = length
        return self.output_text[last_offset:length]

    def _decode_next(self, token_id: int) -> str:
        """Text that token_id completes, or "" while it ends inside a multi-byte character."""
        token = self._id_to_token(token_id)
        if token is None:
            return ""
        self._tokens.append(token)
        prefix_text = self._tokens_to_string(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._tokens_to_string(self._tokens[self._prefix_offset:])
        # A trailing U+FFFD means the last character's bytes are not all here yet: hold it back.
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        # Slide the window: what was unread becomes the context of the next step.
        del self._tokens[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._tokens)
        return new_text[len(prefix_text):]

    def _id_to_token(self, token_id: int) -> str | None:
        """The vocabulary piece of token_id; None when it is a special token being skipped."""
        if token_id in self._special_ids:
            return None
        # An id outside the vocabulary has no piece (the tokenizer returns None): it adds no text.
        return self.tokenizer.convert_ids_to_tokens(int(token_id)) or ""

    def _tokens_to_string(self, tokens: list[str]) -> str:
        if not self._added_vocab:
            return self.tokenizer.convert_tokens_to_string(tokens)
        return _convert_tokens_to_string_with_added_encoders(
            self.tokenizer, tokens, self._added_vocab, self.spaces_between_special_tokens)

    def _check_stop_strings(self, new_text_offset: int) -> str | None:
        """Find a stop string ending in the text added after new_text_offset; cut the text there."""
        if not self.stop or new_text_offset >= len(self.output_text):
            return None
        # A match not seen before must end in the new text, so it starts at most len(s) - 1
        # chars before it. Of several matches the one ending first wins (the one a char-by-char
        # stream meets first, whatever the token batching), then the longer one.
        best: tuple[int, int, str] | None = None
        for stop_str in self.stop:
            start = self.output_text.find(stop_str, max(new_text_offset - len(stop_str) + 1, 0))
            if start == -1:
                continue
            candidate = (start + len(stop_str), start, stop_str)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        end, start, stop_str = best
        self.output_text = self.output_text[:end if self.include_stop_str_in_output else start]
        return stop_str


def _convert_tokens_to_string_with_added_encoders(
        tokenizer: "PreTrainedTokenizerBase", tokens: list[str], added_vocab: frozenset[str],
        spaces_between_special_tokens: bool) -> str:
    """Join tokens to text as a slow tokenizer does: added tokens verbatim, the rest decoded."""
    sub_texts: list[str] = []
    run: list[str] = []
    for token in tokens:
        if token in added_vocab:
            if run:
                sub_texts.append(tokenizer.convert_tokens_to_string(run))
                run = []
            sub_texts.append(token)
        else:
            run.append(token)
    if run:
        sub_texts.append(tokenizer.convert_tokens_to_string(run))
    return (" " if spaces_between_special_tokens else "").join(sub_texts)


def decode_token(tokenizer: "PreTrainedTokenizerBase", token_id: int) -> str:
    """Text of one token alone, as vLLM shows it in `Logprob.decoded_token`."""
    text = tokenizer.decode([token_id]) or ""
    # `decode` drops the leading space of a SentencePiece piece ("▁world" -> "world"); put it
    # back, since in the sequence this token does start with a space.
    piece = tokenizer.convert_ids_to_tokens(token_id) or ""
    marks = len(piece) - len(piece.lstrip(_SPIECE_UNDERLINE))
    missing = marks - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text
