"""Sampler: exact masks, penalties by hand, processors, logprobs, seeding, the distribution."""

import math

import pytest
import torch

from ascendserve.engine.sampling_params import SamplingParams
from ascendserve.worker.sampler import (
    Sampler,
    SamplingRow,
    apply_logits_processors,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    top_k_top_p_candidates,
)

INF = float("inf")


def make_row(prompt=(), output=(), eos=(), **kwargs) -> SamplingRow:
    return SamplingRow(SamplingParams(**kwargs), list(prompt), list(output), frozenset(eos))


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


def survivors(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row > -INF).flatten().tolist()) for row in logits]


# ---- truncation masks -------------------------------------------------------------------------

def test_top_k_mask_exact_with_ties_to_lower_id():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0]] * 4)
    params = [SamplingParams(top_k=k) for k in (1, 2, 3, 0)]
    apply_top_k_top_p(logits, params)
    assert survivors(logits) == [{1}, {1, 3}, {1, 2, 3}, {0, 1, 2, 3, 4}]


def test_top_p_mask_keeps_smallest_prefix_reaching_top_p():
    logits = torch.tensor([log_probs(0.15, 0.5, 0.05, 0.3)] * 5)
    params = [SamplingParams(top_p=p) for p in (0.01, 0.45, 0.7, 0.9, 1.0)]
    apply_top_k_top_p(logits, params)
    assert survivors(logits) == [{1}, {1}, {1, 3}, {0, 1, 3}, {0, 1, 2, 3}]


def test_top_p_ties_keep_lower_token_id():
    logits = torch.tensor([log_probs(0.3, 0.4, 0.3)])
    apply_top_k_top_p(logits, [SamplingParams(top_p=0.5)])
    assert survivors(logits) == [{0, 1}]


def test_top_p_applies_to_top_k_renormalized_probs():
    # top_k=2 leaves [.5, .3] -> renormalized [.625, .375]; top_p .6 keeps only the first.
    logits = torch.tensor([log_probs(0.5, 0.3, 0.2)] * 2)
    apply_top_k_top_p(logits, [SamplingParams(top_k=2, top_p=p) for p in (0.6, 0.7)])
    assert survivors(logits) == [{0}, {0, 1}]


def test_min_p_mask_exact():
    logits = torch.tensor([log_probs(0.5, 0.3, 0.15, 0.05)] * 3)
    apply_min_p(logits, [SamplingParams(min_p=p) for p in (0.2, 0.7, 0.0)])
    assert survivors(logits) == [{0, 1, 2}, {0}, {0, 1, 2, 3}]


@pytest.mark.parametrize("kwargs, allowed", [
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.6}, {0, 1}),
    ({"min_p": 0.6}, {0, 1}),
])
def test_sampled_tokens_stay_inside_the_mask(kwargs, allowed):
    logits = torch.tensor([log_probs(0.4, 0.3, 0.2, 0.1)] * 2000)
    rows = [make_row(**kwargs) for _ in range(2000)]
    assert set(Sampler(seed=0)(logits, rows).sampled_token_ids) == allowed


# ---- the candidates' short cut (top-k / top-p without sorting the vocabulary) ---------------------------------

def _candidate_survivors(logits: torch.Tensor, params: list[SamplingParams], nucleus: int) -> list[set[int]] | None:
    found = top_k_top_p_candidates(logits.clone(), params, nucleus)
    if found is None:
        return None
    values, token_ids = found
    return [set(ids[vals > -INF].tolist()) for vals, ids in zip(values, token_ids)]


def _sorted_survivors(logits: torch.Tensor, params: list[SamplingParams]) -> list[set[int]]:
    masked = logits.clone()
    apply_top_k_top_p(masked, params)
    return survivors(masked)


def test_candidates_keep_what_the_full_sort_keeps():
    # Peaked rows over 3000 tokens with ties across the first places, a mix of top_k, top_p and both (nuclei inside
    # the first five, and one reaching into the tail), and a row whose tail is -inf past 100 tokens.
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(24, 3000, generator=gen) - 2
    logits[:, :5] = torch.tensor([9.0, 9.0, 8.5, 8.5, 8.5])
    logits[3, 100:] = -INF
    params = [SamplingParams(**kw) for kw in [{"top_k": 1}, {"top_k": 2}, {"top_k": 3}, {"top_k": 50},
                                              {"top_p": 0.3}, {"top_p": 0.5, "top_k": 4}, {"top_k": 4, "top_p": 0.9},
                                              {"top_p": 0.985}]]
    params = params * 3
    got = _candidate_survivors(logits, params, 256)
    assert got is not None and got == _sorted_survivors(logits, params)
    assert [len(s) for s in got[:5]] == [1, 2, 3, 50, 2]
    assert 5 < len(got[7]) < 256


def test_candidates_give_up_where_the_k_cannot_tell():
    logits = torch.zeros(1, 400)
    logits[0, :10] = torch.arange(10, 0, -1).float()  # then 390 tied zeros
    assert _candidate_survivors(logits, [SamplingParams(top_k=12)], 256) is None  # the 12th place is a tie
    assert _candidate_survivors(logits, [SamplingParams(top_k=10)], 256) == [set(range(10))]
    flat = torch.randn(1, 5000, generator=torch.Generator().manual_seed(6)) * 0.01  # nearly uniform, no ties
    assert _candidate_survivors(flat, [SamplingParams(top_p=0.9)], 256) is None  # a nucleus of ~4500 tokens
    for top_p, nucleus in ((0.01, 256), (0.5, 4096)):
        params = [SamplingParams(top_p=top_p)]
        assert _candidate_survivors(flat, params, nucleus) == _sorted_survivors(flat, params)
    assert _candidate_survivors(flat, [SamplingParams(top_p=0.5)], 5000) is None  # K = the vocabulary: the sort


def test_truncated_sampling_on_candidates_matches_the_renormalized_softmax():
    # vocab 1000, top_k 3 with top_p: the candidate path; frequencies against the kept tokens' renormalized softmax.
    base = torch.full((1000,), -4.0)
    base[[7, 500, 999, 3]] = torch.tensor([1.0, 1.5, 0.5, 0.2])
    draws = 12000
    rows = [make_row(top_k=3, top_p=0.95) for _ in range(draws)]
    tokens = torch.tensor(Sampler(seed=0)(base.expand(draws, 1000).clone(), rows).sampled_token_ids)
    frequencies = torch.bincount(tokens, minlength=1000).float() / draws
    kept = torch.tensor([7, 500, 999])
    expected = torch.zeros(1000)
    expected[kept] = torch.softmax(base[kept], -1)
    torch.testing.assert_close(frequencies, expected, atol=0.02, rtol=0)


def test_seeded_row_draws_the_same_token_on_candidates_and_after_the_sort():
    gen = torch.Generator().manual_seed(5)
    target = torch.randn(2000, generator=gen) * 2
    tied = torch.zeros(2000)
    tied[:3] = 5.0  # top_k 3 then ties at the 4th place: the batch falls back to the full sort

    def draw(step: int, with_tie: bool) -> int:
        rows = [make_row(output=[1] * step, seed=99, top_k=40, top_p=0.9, temperature=0.8)]
        logits = [target]
        if with_tie:
            rows.append(make_row(top_k=4))
            logits.append(tied)
        return Sampler(seed=step)(torch.stack(logits), rows).sampled_token_ids[0]

    drawn = [draw(step, False) for step in range(12)]
    assert drawn == [draw(step, True) for step in range(12)]
    assert len(set(drawn)) > 1


def test_mixed_batch_of_truncated_and_whole_vocabulary_rows():
    logits = torch.tensor(log_probs(0.4, 0.3, 0.2, 0.1) + [-30.0] * 996).expand(3000, 1000).clone()
    rows = [make_row(top_k=2) if i % 2 else make_row() for i in range(3000)]
    tokens = Sampler(seed=1)(logits, rows).sampled_token_ids
    assert set(tokens[1::2]) == {0, 1}
    assert set(tokens[0::2]) == {0, 1, 2, 3}


def test_whole_vocabulary_draws_match_the_softmax_across_blocks_and_skip_masked_tokens():
    # 1000 tokens (blocks of 256, the last one padded): mass on both sides of block edges, -inf holes between.
    base = torch.full((1000,), -INF)
    live = torch.tensor([0, 255, 256, 511, 700, 999])
    base[live] = torch.tensor([0.5, 1.0, 0.0, 1.5, -0.5, 0.8])
    draws = 12000
    rows = [make_row(temperature=1.0) for _ in range(draws)]
    tokens = torch.tensor(Sampler(seed=3)(base.expand(draws, 1000).clone(), rows).sampled_token_ids)
    assert set(tokens.tolist()) <= set(live.tolist())
    frequencies = torch.bincount(tokens, minlength=1000).float()[live] / draws
    torch.testing.assert_close(frequencies, torch.softmax(base[live], -1), atol=0.02, rtol=0)


def test_seeded_whole_vocabulary_row_is_independent_of_its_batch():
    target = torch.randn(700, generator=torch.Generator().manual_seed(8))

    def draw(step: int, others: int) -> int:
        rows = [make_row() for _ in range(others)] + [make_row(output=[2] * step, seed=77)]
        logits = torch.cat([torch.randn(others, 700), target[None]])
        return Sampler(seed=others)(logits, rows).sampled_token_ids[-1]

    drawn = [draw(step, 0) for step in range(10)]
    assert drawn == [draw(step, 5) for step in range(10)] and len(set(drawn)) > 1


# ---- penalties and processors -----------------------------------------------------------------

PENALTY_LOGITS = [2.0, -1.0, 0.5, -0.5, 1.0]


@pytest.mark.parametrize("kwargs, expected", [
    # prompt {0, 3}, output [2, 2, 4]: seen {0, 2, 3, 4}; output counts {2: 2, 4: 1}.
    ({"repetition_penalty": 2.0}, [1.0, -1.0, 0.25, -1.0, 0.5]),
    ({"frequency_penalty": 0.5}, [2.0, -1.0, -0.5, -0.5, 0.5]),
    ({"presence_penalty": 0.3}, [2.0, -1.0, 0.2, -0.5, 0.7]),
    ({"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.3},
     [1.0, -1.0, -1.05, -1.0, -0.3]),
    ({}, PENALTY_LOGITS),
])
def test_penalties_match_hand_computation(kwargs, expected):
    logits = torch.tensor([PENALTY_LOGITS, PENALTY_LOGITS])
    rows = [make_row(prompt=[0, 3], output=[2, 2, 4], **kwargs), make_row(output=[0, 1, 2])]
    apply_penalties(logits, rows)
    torch.testing.assert_close(logits[0], torch.tensor(expected))
    torch.testing.assert_close(logits[1], torch.tensor(PENALTY_LOGITS))


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_logit_bias_and_allowed_token_ids(temperature):
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    rows = [make_row(temperature=temperature, logit_bias={"0": 5.0}),
            make_row(temperature=temperature, allowed_token_ids=[0, 2]),
            make_row(temperature=temperature, allowed_token_ids=[1, 2], logit_bias={1: 1.5})]
    if temperature == 0.0:
        assert Sampler()(logits, rows).sampled_token_ids == [0, 2, 1]
    apply_logits_processors(logits, rows)
    assert logits.tolist() == [[5.0, 1.0, 2.0, 3.0], [0.0, -INF, 2.0, -INF], [-INF, 2.5, 2.0, -INF]]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]] * 4)
    common = {"temperature": 0, "min_tokens": 3, "stop_token_ids": [3], "eos": [4]}
    rows = [make_row(output=[0, 0], **common), make_row(output=[0, 0, 0], **common),
            make_row(output=[0], ignore_eos=True, **common), make_row(output=[], eos=[4], temperature=0)]
    assert Sampler()(logits, rows).sampled_token_ids == [2, 4, 4, 4]
    apply_logits_processors(logits, rows)
    assert logits[0].tolist() == [0.0, 1.0, 2.0, -INF, -INF]
    assert logits[2].tolist() == [0.0, 1.0, 2.0, -INF, 4.0]


# ---- greedy and logprobs ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    rows = [make_row(temperature=0) for _ in range(6)]
    assert Sampler()(logits, rows).sampled_token_ids == logits.argmax(-1).tolist()
    rows[2] = make_row(temperature=0.7, top_k=1)  # a random row forces the general path
    assert Sampler()(logits, rows).sampled_token_ids == logits.argmax(-1).tolist()


def test_logprobs_are_raw_with_ranks_and_top_k_order():
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(1))
    rows = [make_row(logprobs=3, temperature=0.5, repetition_penalty=1.5, output=[1, 2]),
            make_row(logprobs=0, temperature=0, logit_bias={5: 100.0}),
            make_row(),
            make_row(logprobs=-1, seed=3)]
    out = Sampler(seed=0)(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None and out.sampled_token_ids[1] == 5
    for i, k in [(0, 3), (1, 0), (3, 12)]:
        entry, token = out.logprobs[i], out.sampled_token_ids[i]
        top_values, top_ids = raw[i].topk(k)
        assert entry.token_ids == [token] + top_ids.tolist()
        torch.testing.assert_close(torch.tensor(entry.logprobs), raw[i, entry.token_ids])
        rank = int((raw[i] > raw[i, token]).sum()) + 1
        assert entry.ranks == [rank] + list(range(1, k + 1))
        assert entry.logprobs[1:] == sorted(entry.logprobs[1:], reverse=True)


# ---- seeding ----------------------------------------------------------------------------------

def _flat_logits(batch: int) -> torch.Tensor:
    return torch.randn(batch, 64, generator=torch.Generator().manual_seed(2)) * 0.3


def test_seeded_row_is_independent_of_its_batch():
    target_logits = _flat_logits(1)[0]

    def draw(step: int, others: list[SamplingRow], position: int, engine_seed: int) -> int:
        rows = list(others)
        rows.insert(position, make_row(output=[7] * step, seed=1234, top_p=0.95))
        logits = _flat_logits(len(rows))
        logits[position] = target_logits
        return Sampler(seed=engine_seed)(logits, rows).sampled_token_ids[position]

    batches = [([], 0),
               ([make_row(), make_row(temperature=0)], 1),
               ([make_row(seed=1), make_row(top_k=3), make_row(repetition_penalty=1.3, output=[1]),
                 make_row(logprobs=2, seed=1234)], 3)]
    for step in range(8):
        tokens = {draw(step, others, pos, seed) for seed in (0, 1) for others, pos in batches}
        assert len(tokens) == 1, (step, tokens)
    assert len({draw(step, [], 0, 0) for step in range(8)}) > 1  # steps draw fresh numbers


def test_unseeded_rows_reproduce_with_the_same_engine_seed():
    logits = _flat_logits(32)
    rows = [make_row() for _ in range(32)]

    def run(seed: int) -> list[list[int]]:
        sampler = Sampler(seed=seed)
        return [sampler(logits, rows).sampled_token_ids for _ in range(3)]

    first = run(5)
    assert first == run(5) and first != run(6)
    assert first[0] != first[1]  # the engine generator advances between steps


@pytest.mark.parametrize("temperature, seeded", [(1.0, False), (0.5, False), (1.0, True)])
def test_sampled_frequencies_match_softmax(temperature, seeded):
    draws = 20000 if not seeded else 8000
    base = torch.tensor([0.0, 1.0, 2.0, 2.5])
    rows = [make_row(temperature=temperature, seed=i if seeded else None) for i in range(draws)]
    tokens = torch.tensor(Sampler(seed=0)(base.expand(draws, 4), rows).sampled_token_ids)
    frequencies = torch.bincount(tokens, minlength=4).float() / draws
    expected = torch.softmax(base / temperature, -1)
    torch.testing.assert_close(frequencies, expected, atol=0.025, rtol=0)
