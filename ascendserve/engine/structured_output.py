"""Structured outputs: a grammar per request masks each step's logits to the tokens it allows.

What vLLM calls structured outputs (`response_format`, `structured_outputs`, the older `guided_json` / `guided_regex`
/ `guided_choice` / `guided_grammar`), on llguidance: the Rust grammar engine behind vLLM's `guidance` backend (on a
2-core CPU, Qwen3.5's 248k vocabulary: a step's mask ~0.6 ms for one row, ~10 ms for 64). Flow: the engine compiles a
request's `StructuredOutputsParams` once (`GrammarCompiler.compile`, a ValueError naming the problem for a bad
schema / regex / grammar) and gives each child sequence its own `GrammarState`; the sampler masks the logits of rows
whose grammar is active (`worker/sampler.py` apply_grammar_masks); every token appended to a request is consumed by its
grammar (`Request.append_output_token`), and a grammar that has ended finishes the request with "stop".

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

    @classmethod
    def from_dict(cls, spec: dict) -> "StructuredOutputsParams":
        """vLLM's dict form ({"json": {...}}, {"regex": ...}, ...); ValueError naming a key that is no constraint."""
        unknown = sorted(set(spec) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown constraint {unknown}; expected one of json, regex, choice, grammar, "
                             f"json_object.")
        return cls(**spec)

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
    """One sequence's grammar: the llguidance matcher, fed every token the sequence generates. Only the engine thread
    touches the matcher between steps (accept, in Scheduler.update_from_output) and the model thread during one (the
    mask): with async scheduling the two overlap, so what the output side needs is kept in plain fields (`ended`)."""

    def __init__(self, matcher, wait_for: int | None = None) -> None:
        self.matcher = matcher
        self.wait_for = wait_for  # a token (</think>) after which the grammar starts; None: from the first token
        self.ended = False  # the grammar ran to its end: the output is complete
        self.failed = False  # the grammar rejected a token: generation goes on unconstrained

    @property
    def active(self) -> bool:
        """Whether this step's token is constrained."""
        return self.wait_for is None and not self.ended and not self.failed

    def accept(self, token_id: int) -> None:
        """Consume a generated token (before the grammar starts: watch for its start token)."""
        if self.wait_for is not None:
            if token_id == self.wait_for:
                self.wait_for = None
            return
        if not self.active:
            return
        if self.matcher.consume_token(token_id):
            self.ended = self.matcher.is_stopped()
            return
        # Only a token the mask allowed is sampled, unless another processor banned all of those (min_tokens, say):
        # say so, and stop constraining rather than end the request as if its output were complete.
        self.failed = True
        logger.error("Structured output: the grammar rejected token %d (%s); the rest of the output is not "
                     "constrained", token_id, self.matcher.get_error())


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
            self._tokenizer()
        except (ValueError, TypeError) as e:
            raise ValueError(f"{GRAMMAR_ERROR_PREFIX}: the {_kind(params)} could not be compiled: {e}") from None
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)  # errors: ours, below
        if matcher.is_error():
            raise ValueError(f"{GRAMMAR_ERROR_PREFIX}: the {_kind(params)} could not be compiled: "
                             f"{matcher.get_error().strip()}")
        matchers = [matcher] + [matcher.deep_copy() for _ in range(count - 1)]  # compiled once for the n children
        return [GrammarState(m, wait_for) for m in matchers]

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
