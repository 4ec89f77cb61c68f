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


def beam_search(generate, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids,
                max_model_len: int) -> list[list[BeamSearchSequence]]:
    """The best `params.beam_width` beams of each token-id prompt, best first, unfinished text not yet decoded.

    `generate(token_id_prompts, sampling_params)` runs one engine step's requests and returns their RequestOutputs in
    order. A beam ends at an EOS (unless ignore_eos; finish reason "stop"), at max_tokens or where the next token would
    not fit in max_model_len ("length")."""
    width, penalty = params.beam_width, params.length_penalty
    rank = lambda beam: beam_search_score(beam, eos_token_ids, penalty)  # noqa: E731
    step_params = SamplingParams(n=1, temperature=params.temperature, max_tokens=1, logprobs=2 * width,
                                 ignore_eos=True)
    live = [[BeamSearchSequence(list(prompt))] for prompt in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        beams = [beam for group in live for beam in group]
        if not beams:
            break
        outputs = generate([beam.tokens for beam in beams], step_params)
        results = iter(outputs)
        for i, group in enumerate(live):
            candidates = []
            for beam in group:
                step = next(results).outputs[0].logprobs[0]
                for token_id, logprob in step.items():
                    new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [step],
                                             beam.cum_logprob + logprob.logprob)
                    if token_id in eos_token_ids and not params.ignore_eos:
                        new.finish_reason = "stop"
                        done[i].append(new)
                    elif len(new.tokens) >= max_model_len:  # no room for another token
                        new.finish_reason = "length"
                        done[i].append(new)
                    else:
                        candidates.append(new)
            live[i] = sorted(candidates, key=rank, reverse=True)[:width]
    results = []
    for group, finished in zip(live, done):
        for beam in group:
            beam.finish_reason = beam.finish_reason or "length"
        results.append(sorted(finished + group, key=rank, reverse=True)[:width])
    return results
