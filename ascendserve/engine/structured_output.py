"""Structured outputs: a grammar per request masks each step's logits to the tokens it allows.

What vLLM calls structured outputs (`response_format`, `structured_outputs`, the older `guided_json` / `guided_regex`
/ `guided_choice` / `guided_grammar`), on llguidance: the Rust grammar engine behind vLLM's `guidance` backend (on a
2-core CPU, Qwen3.5's 248k vocabulary: a step's mask ~0.6 ms for one row, ~10 ms for 64). Flow: the engine compiles a
request's `StructuredOutputsParams` once (`GrammarCompiler.compile`, a ValueError naming the problem for a bad
schema / regex / grammar) and gives each child sequence its own `GrammarState`; the sampler masks the logits of rows
whose grammar is active (`apply_grammar_masks`); every token appended to a request is consumed by its grammar
(`Request.append_output_token`), and a grammar that has ended finishes the request with "stop".

A reasoning model's thinking is left free: a state made with `wait_for` only starts constraining after that token
(`</think>`) has been generated, as vLLM does with a reasoning parser.
"""

import json
from dataclasses import dataclass, fields

from ascendserve.logger import init_logger

logger = init_logger(__name__)

# How every error about a request's grammar begins (the server names the request field it came from).
GRAMMAR_ERROR_PREFIX = "structured outputs"


@dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one of these constraints.

    json: a JSON schema (dict or its JSON text); regex: a regular expression (Rust regex syntax) the whole output
    matches; choice: the output is one of these strings; grammar: a Lark grammar (llguidance's dialect) or GBNF;
    json_object: any JSON object (`response_format: {"type": "json_object"}`).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs need exactly one of json, regex, choice, grammar or json_object; "
                             f"got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of strings")

    def llguidance_grammar(self) -> str:
        """The llguidance grammar of this constraint (ValueError if it cannot be built)."""
        import llguidance

        if self.json_object:
            return llguidance.grammar_from("json", '{"type": "object"}')
        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return llguidance.grammar_from("json", schema)
        if self.regex is not None:
            return llguidance.grammar_from("regex", self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("choice", self.choice)
        return llguidance.grammar_from("grammar", self.grammar)


class GrammarState:
    """One sequence's grammar: the llguidance matcher, fed every token the sequence generates."""

    def __init__(self, matcher, wait_for: int | None = None) -> None:
        self.matcher = matcher
        self.wait_for = wait_for  # a token (</think>) after which the grammar starts; None: from the first token

    @property
    def active(self) -> bool:
        """Whether this step's token is constrained."""
        return self.wait_for is None and not self.matcher.is_stopped()

    def accept(self, token_id: int) -> None:
        """Consume a generated token (before the grammar starts: watch for its start token)."""
        if self.wait_for is not None:
            if token_id == self.wait_for:
                self.wait_for = None
            return
        if not self.matcher.is_stopped() and not self.matcher.consume_token(token_id):
            # only a token the mask allowed is sampled, so this is the engine's fault: say so, and stop constraining
            logger.error("Structured output: the grammar rejected token %d (%s)", token_id, self.matcher.get_error())

    @property
    def ended(self) -> bool:
        """Whether the grammar has run to its end (the output is complete)."""
        return self.wait_for is None and self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles StructuredOutputsParams into GrammarStates for one tokenizer. Its llguidance form is built on first use
    (Qwen3.5's tokenizer: ~3.3 s, and ~2 s more in the first mask; the demo's: ~0.3 s), so the first structured request
    of a server waits that long once."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None

    def compile(self, params: StructuredOutputsParams, count: int, wait_for: int | None = None) -> list[GrammarState]:
        """`count` fresh states of one grammar (a request's `n` children); ValueError for a grammar that does not
        compile, naming what llguidance reported."""
        import llguidance

        if self.tokenizer is None:
            raise ValueError(f"{GRAMMAR_ERROR_PREFIX} need a tokenizer (this engine runs with skip_tokenizer_init)")
        try:
            grammar = params.llguidance_grammar()
        except (ValueError, TypeError) as e:
            raise ValueError(f"{GRAMMAR_ERROR_PREFIX}: the {_kind(params)} could not be compiled: {e}") from None
        message = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer())  # "" when it compiles
        if message:
            raise ValueError(f"{GRAMMAR_ERROR_PREFIX}: the {_kind(params)} could not be compiled: {message.strip()}")
        return [GrammarState(llguidance.LLMatcher(self._tokenizer(), grammar), wait_for) for _ in range(count)]

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_ids or None)
        return self._ll_tokenizer


def _kind(params: StructuredOutputsParams) -> str:
    if params.json_object or params.json is not None:
        return "JSON schema"
    return "regex" if params.regex is not None else "choice" if params.choice is not None else "grammar"


def apply_grammar_masks(logits, grammars: list) -> None:
    """Set to -inf, in place, every token the row's active grammar does not allow next (rows without one untouched):
    logits [rows, vocab] fp32, grammars one GrammarState or None a row."""
    import llguidance.torch as llg_torch

    rows = [i for i, g in enumerate(grammars) if g is not None and g.active]
    if not rows:
        return
    bitmask = llg_torch.allocate_token_bitmask(len(rows), logits.shape[1])
    for j, i in enumerate(rows):
        llg_torch.fill_next_token_bitmask(grammars[i].matcher, bitmask, j)
    banned = ~_unpack_bitmask(bitmask, logits.shape[1]).to(logits.device)
    for j, i in enumerate(rows):  # in place, row by row (a gather + scatter of 64 rows x 248k: ~40 ms more)
        logits[i].masked_fill_(banned[j], float("-inf"))


def _unpack_bitmask(bitmask, vocab: int):
    """[rows, ceil(vocab / 32)] int32 words (bit b of word w: token 32 w + b) -> [rows, vocab] bool. Unpacked as the
    words' little-endian bytes by numpy: 64 rows of a 248k vocabulary in ~3 ms (shifting the int32 words: ~60 ms)."""
    import numpy as np
    import torch

    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))
