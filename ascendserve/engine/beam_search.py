"""Beam search as vLLM's V1 frontend runs it: one engine step per generated token for every live beam (one token,
the top 2 x beam_width logprobs), the beams then ranked by cumulative logprob over length ** length_penalty.

Worked example, beam_width 1, prompt [5]: the step gives {7: -0.1, 9: -2.0, eos: -3.0} -> beams [5, 7] (-0.1) and
[5, 9] (-2.0), EOS completed at -3.0; the best one beam, [5, 7], goes on; at max_tokens the completed and the live
beams are ranked together and the best beam_width returned.
"""

from dataclasses import dataclass, field

from ascendserve.engine.outputs import Logprob
from ascendserve.engine.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's first, as vLLM's), the logprobs of each generated step, the cumulative
    logprob of the generated tokens, and (on the results) its text and finish reason."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(beam: BeamSearchSequence, eos_token_ids, length_penalty: float) -> float:
    """vLLM's ranking: cum_logprob / length ** length_penalty, the length counting the prompt and not a final EOS."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """The search over token-id prompts, one step at a time: `pending()` is the live beams' token lists to run through
    the engine with `step_params` (one token, the top 2 x beam_width logprobs), `advance()` takes their RequestOutputs
    in that order, `results()` the best beams of each prompt, best first. A beam ends at an EOS (unless ignore_eos;
    finish reason "stop"), at max_tokens or where the next token would not fit in max_model_len ("length")."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids, max_model_len: int) -> None:
        self.params, self.eos_token_ids, self.max_model_len = params, eos_token_ids, max_model_len
        self.step_params = SamplingParams(n=1, temperature=params.temperature, max_tokens=1,
                                          logprobs=2 * params.beam_width, ignore_eos=True)
        self.live = [[BeamSearchSequence(list(prompt))] for prompt in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    def _rank(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam, self.eos_token_ids, self.params.length_penalty)

    def pending(self) -> list[list[int]]:
        """The token lists to extend this step; none once max_tokens steps ran or every beam ended."""
        if self.steps >= self.params.max_tokens:
            return []
        return [beam.tokens for group in self.live for beam in group]

    def advance(self, outputs) -> None:
        """Extend each live beam by the tokens of its step's logprobs; keep the best beam_width live beams."""
        results = iter(outputs)
        for i, group in enumerate(self.live):
            candidates = []
            for beam in group:
                step = next(results).outputs[0].logprobs[0]
                for token_id, logprob in step.items():
                    new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [step],
                                             beam.cum_logprob + logprob.logprob)
                    if token_id in self.eos_token_ids and not self.params.ignore_eos:
                        new.finish_reason = "stop"
                        self.done[i].append(new)
                    elif len(new.tokens) >= self.max_model_len:  # no room for another token
                        new.finish_reason = "length"
                        self.done[i].append(new)
                    else:
                        candidates.append(new)
            self.live[i] = sorted(candidates, key=self._rank, reverse=True)[:self.params.beam_width]
        self.steps += 1

    def results(self) -> list[list[BeamSearchSequence]]:
        out = []
        for group, finished in zip(self.live, self.done):
            for beam in group:
                beam.finish_reason = beam.finish_reason or "length"
            out.append(sorted(finished + group, key=self._rank, reverse=True)[:self.params.beam_width])
        return out


def beam_search(generate, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids,
                max_model_len: int) -> list[list[BeamSearchSequence]]:
    """Run a BeamSearch to its end; `generate(token_id_prompts, sampling_params)` returns the RequestOutputs of one
    step's requests in order."""
    search = BeamSearch(prompts, params, eos_token_ids, max_model_len)
    while batch := search.pending():
        search.advance(generate(batch, search.step_params))
    return search.results()
