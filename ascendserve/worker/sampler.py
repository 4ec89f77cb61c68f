"""Turns a batch of logits into next tokens, in vLLM v1's order.

Per row, on float32 copies of the logits:
  0. structured outputs: the tokens the row's grammar does not allow next -> -inf
  1. allowed_token_ids: every other token -> -inf
  2. logit_bias: added
  3. min_tokens: eos (unless ignore_eos) and stop_token_ids -> -inf while len(output) < min_tokens
  4. penalties: repetition (prompt + output), then frequency and presence (output only)
  5. greedy rows: argmax
     random rows: / temperature, min-p, top-k, top-p, then one draw from the softmax (with a top-k or top-p, among
     the row's likeliest tokens where they settle the mask: top_k_top_p_candidates; without, against the
     cumulative probabilities)
Logprobs are those of the raw model logits (vLLM's default `raw_logprobs`).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ascendserve.engine.sampling_params import SamplingParams
from ascendserve.layers import cpu_kernels

_NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One row of the batch logits: its request's params and the tokens it has seen."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    # Generated so far: drives penalties, min_tokens and the per-step seed.
    output_token_ids: Sequence[int]
    # Masked while len(output_token_ids) < params.min_tokens, unless params.ignore_eos.
    eos_token_ids: frozenset[int] = frozenset()
    # Structured outputs: the request's GrammarState (read when the step samples: it has seen every earlier token).
    grammar: object | None = None


@dataclass
class LogprobsRow:
    """Raw logprobs of the sampled token followed by the row's top-k tokens."""

    # [sampled token] + top-k token ids (k = params.logprobs, the vocabulary size for -1).
    token_ids: list[int]
    logprobs: list[float]
    # 1-based rank in the vocabulary: the sampled token's true rank, then 1..k.
    ranks: list[int]


@dataclass
class SamplerOutput:
    """One sampled token per row, and its logprobs where the row asked for them."""

    sampled_token_ids: list[int]
    # None where params.logprobs is None.
    logprobs: list[LogprobsRow | None]


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of [rows, vocab] logits: the C++ op (csrc/argmax_cpu.cpp, the same indices;
    64 x 248320 logits 16 -> 5 ms, one row 0.45 -> 0.04 ms) for contiguous fp32 CPU logits."""
    ops = cpu_kernels.fp32_ops(logits) if logits.is_contiguous() and logits.shape[-1] > 0 else None
    return ops.argmax_rows(logits) if ops is not None else logits.argmax(dim=-1)


class Sampler:
    """Samples one token per row; a seeded row draws the same tokens whatever shares its batch."""

    def __init__(self, seed: int | None = None):
        # Unseeded random rows share one generator per device, seeded once from `seed`.
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample the next token of each row of `logits` [len(rows), vocab]."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        raw_logprobs = _raw_logprobs(logits, rows)
        if all(_is_plain_greedy(row) for row in rows):
            sampled = argmax_rows(logits)
        else:
            processed = apply_logits_processors(logits.to(torch.float32, copy=True), rows)
            sampled = self._sample(processed, rows)
        token_ids = sampled.tolist()
        return SamplerOutput(token_ids, _gather_logprobs(raw_logprobs, token_ids, rows))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        random = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        return _by_part(logits, rows, random, self._sample_random, lambda part, _: argmax_rows(part))

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        params = [row.params for row in rows]
        logits.div_(_column([p.temperature for p in params], logits))
        apply_min_p(logits, params)
        vocab_size = logits.shape[1]
        cut = [i for i, (top_k, p) in enumerate(zip(_top_ks(params, vocab_size), params))
               if top_k < vocab_size or p.top_p < 1.0]
        return _by_part(logits, rows, cut, self._sample_truncated, self._draw)

    def _sample_truncated(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Rows with a top_k or top_p: the race among their candidates (top_k_top_p_candidates), or over the whole
        vocabulary masked by the full sort where the candidates cannot tell."""
        params = [row.params for row in rows]
        top_p_alone = logits.shape[1] in _top_ks(params, logits.shape[1])  # a longer list can settle those
        for nucleus in NUCLEUS_CANDIDATES if top_p_alone else NUCLEUS_CANDIDATES[:1]:
            candidates = top_k_top_p_candidates(logits, params, nucleus)
            if candidates is not None:
                break
        if candidates is None:
            apply_top_k_top_p(logits, params)
            return self._race(logits, rows)
        values, token_ids = candidates
        picked = self._race(values, rows, token_ids, logits.shape[1])
        return token_ids.gather(1, picked.unsqueeze(1)).squeeze(1)

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Rows over the whole vocabulary: one U[0, 1) draw a row against the cumulative probabilities, summed in fp32
        within blocks of CDF_BLOCK tokens and in float64 across them (the race's Exp(1) draw a token took ~40 ms for 64
        rows of Qwen3.5's 248320 logits on two cores)."""
        probs = logits.softmax(dim=-1)
        num_rows, vocab_size = probs.shape
        pad = -vocab_size % CDF_BLOCK
        within = (F.pad(probs, (0, pad)) if pad else probs).view(num_rows, -1, CDF_BLOCK).cumsum(dim=-1)
        ends = within[:, :, -1].double().cumsum(dim=-1)  # where each block's mass ends
        target = (self._uniforms(rows, probs.device) * ends[:, -1]).unsqueeze(1)  # below the row's total
        block = torch.searchsorted(ends, target, right=True).clamp_(max=ends.shape[1] - 1)
        start = torch.where(block > 0, ends.gather(1, (block - 1).clamp(min=0)), 0.0)
        inner = within.gather(1, block.unsqueeze(2).expand(-1, -1, CDF_BLOCK)).squeeze(1).double()
        offset = torch.searchsorted(inner, target - start, right=True).clamp_(max=CDF_BLOCK - 1)
        tokens = (block * CDF_BLOCK + offset).squeeze(1).clamp_(max=vocab_size - 1)
        # Rounding can carry a draw past its block's last token with mass; such a row takes its likeliest token.
        lost = probs.gather(1, tokens.unsqueeze(1)).squeeze(1) == 0
        return torch.where(lost, argmax_rows(probs), tokens) if bool(lost.any()) else tokens

    def _uniforms(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """One float64 U[0, 1) draw a row."""
        return self._per_row(rows, device, lambda n, generator, _: torch.rand(
            n, dtype=torch.float64, device=device, generator=generator))

    def _per_row(self, rows: list[SamplingRow], device: torch.device, draw) -> torch.Tensor:
        """Random draws stacked in row order: draw(n, generator, j) makes n rows' worth, the unseeded rows' in one call
        on the engine's generator (j None), each seeded row j's (n = 1) on its own (_row_generator), so a seeded row
        draws the same numbers in any batch."""
        unseeded = [j for j, row in enumerate(rows) if row.params.seed is None]
        if len(unseeded) == len(rows):
            return draw(len(rows), self._engine_generator(device), None)
        order = list(unseeded)
        parts = [draw(len(unseeded), self._engine_generator(device), None)] if unseeded else []
        for j, row in enumerate(rows):
            if row.params.seed is not None:
                order.append(j)
                parts.append(draw(1, _row_generator(row, device), j))
        stacked = torch.cat(parts)
        out = torch.empty_like(stacked)
        out[_index(order, device)] = stacked
        return out

    def _race(self, logits: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor | None = None,
              vocab_size: int = 0) -> torch.Tensor:
        """The column of each row drawn with probability softmax(logits): columns are token ids, or candidates whose
        ids `token_ids` gives (of a vocabulary of vocab_size)."""
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p_i / E_i), E_i ~ Exp(1), picks column i with probability p_i.
        return argmax_rows(probs.div_(self._exponential_noise(probs, rows, token_ids, vocab_size)))

    def _exponential_noise(self, probs: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor | None,
                           vocab_size: int) -> torch.Tensor:
        """Exp(1) draws, one per column. A seeded row draws one per token of the vocabulary whatever its columns (its
        candidates' are taken by token_ids), so it samples the same token in any batch, by any path."""
        device, columns = probs.device, probs.shape[1]

        def draw(n: int, generator: torch.Generator, j: int | None) -> torch.Tensor:
            if j is None or token_ids is None:
                return _exponential(torch.empty((n, columns), device=device), generator)
            return _exponential(torch.empty((1, vocab_size), device=device), generator)[:, token_ids[j]]

        noise = self._per_row(rows, device, draw)
        # E = -log U is 0 where U is 1 (CUDA draws from (0, 1]), and p / 0 infinite; p / tiny stays finite for p <= 1.
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)

    def _engine_generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed & _MASK64)
            self._generators[device] = generator
        return generator


def apply_logits_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Apply grammars, allowed_token_ids, logit_bias, min_tokens, bad_words and penalties to float32 logits in
    place."""
    if any(row.grammar is not None for row in rows):
        apply_grammar_masks(logits, [row.grammar for row in rows])
    _apply_allowed_token_ids(logits, rows)
    _apply_logit_bias(logits, rows)
    _ban(logits, rows, _min_tokens_banned)
    _ban(logits, rows, _bad_words_banned)
    apply_penalties(logits, rows)
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties to `logits` in place (vLLM's formulas)."""
    penalized = [i for i, row in enumerate(rows) if _has_penalty(row.params)]
    if not penalized:
        return logits
    chosen = [rows[i] for i in penalized]
    params = [row.params for row in chosen]
    index = _index(penalized, logits.device)
    vocab_size = logits.shape[1]
    out_counts = _token_counts([row.output_token_ids for row in chosen], vocab_size, logits)
    sub = logits[index]
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = _token_counts([row.prompt_token_ids for row in chosen], vocab_size, logits)
        seen = (prompt_counts > 0) | (out_counts > 0)
        scale = torch.where(seen, _column([p.repetition_penalty for p in params], logits), 1.0)
        # Positive logits are divided and the others multiplied, so a penalty > 1 always lowers.
        sub = torch.where(sub > 0, sub / scale, sub * scale)
    sub -= _column([p.frequency_penalty for p in params], logits) * out_counts
    sub -= _column([p.presence_penalty for p in params], logits) * (out_counts > 0)
    logits[index] = sub
    return logits


def apply_grammar_masks(logits: torch.Tensor, grammars: list) -> None:
    """Set to -inf, in place, every token the row's active grammar (engine/structured_output.GrammarState) does not
    allow next; rows without one are untouched. On a 2-core CPU with Qwen3.5's 248k vocabulary: ~0.6 ms for one row,
    ~10 ms for 64 (`benchmarks/probe_grammar_masks.py`)."""
    import llguidance.torch as llg_torch

    rows = [i for i, g in enumerate(grammars) if g is not None and g.active]
    if not rows:
        return
    bitmask = llg_torch.allocate_token_bitmask(len(rows), logits.shape[1])
    for j, i in enumerate(rows):
        llg_torch.fill_next_token_bitmask(grammars[i].matcher, bitmask, j)
    if logits.device.type == "cpu":
        banned = ~unpack_bitmask(bitmask, logits.shape[1])
    else:  # the int32 words cross to the device (32x fewer bytes than a bool mask) and are unpacked there
        banned = ~unpack_bitmask_on_device(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    for j, i in enumerate(rows):  # in place, row by row (a gather + scatter of 64 rows x 248k: ~40 ms more)
        logits[i].masked_fill_(banned[j], _NEG_INF)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 words (bit b of word w: token 32 w + b) -> [rows, vocab] bool. Unpacked as the
    words' little-endian bytes by numpy: 64 rows of a 248k vocabulary in ~3 ms (shifting the int32 words: ~60 ms)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def unpack_bitmask_on_device(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """unpack_bitmask with torch ops on the words' own device (a GPU / NPU: shifts, one kernel each)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # >> keeps the sign: bit 31 is & 1 of -1, still 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def _apply_allowed_token_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    limited = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if not limited:
        return
    mask = torch.ones((len(limited), logits.shape[1]), dtype=torch.bool, device=logits.device)
    row_ids, token_ids = [], []
    for j, i in enumerate(limited):
        allowed = rows[i].params.allowed_token_ids
        row_ids += [j] * len(allowed)
        token_ids += allowed
    mask[_index(row_ids, logits.device), _index(token_ids, logits.device)] = False
    index = _index(limited, logits.device)
    logits[index] = logits[index].masked_fill_(mask, _NEG_INF)


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    row_ids, token_ids, biases = [], [], []
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            row_ids.append(i)
            token_ids.append(token_id)
            biases.append(bias)
    if row_ids:
        values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
        where = (_index(row_ids, logits.device), _index(token_ids, logits.device))
        logits.index_put_(where, values, accumulate=True)


def _ban(logits: torch.Tensor, rows: list[SamplingRow], banned_of) -> None:
    """Set to -inf, in place, the tokens `banned_of(row)` lists for each row."""
    row_ids, token_ids = [], []
    for i, row in enumerate(rows):
        banned = banned_of(row)
        row_ids += [i] * len(banned)
        token_ids += banned
    if row_ids:
        logits[_index(row_ids, logits.device), _index(token_ids, logits.device)] = _NEG_INF


def _bad_words_banned(row: SamplingRow) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far (vLLM reads the output only):
    words [[5], [7, 8]] after output [.., 7] ban [5, 8]."""
    banned = []
    out = row.output_token_ids
    for word in row.params.bad_words_token_ids or ():
        head = len(word) - 1
        if head == 0 or (head <= len(out) and list(out[len(out) - head:]) == word[:-1]):
            banned.append(word[-1])
    return banned


def _min_tokens_banned(row: SamplingRow) -> list[int]:
    params = row.params
    if len(row.output_token_ids) >= params.min_tokens:
        return []
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned |= row.eos_token_ids
    return sorted(banned)


def apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Mask in place each row's tokens less likely than min_p times its likeliest token."""
    # Keeps prob >= min_p * max prob: probs [.5, .3, .15, .05], min_p .2 -> the first 3.
    if all(p.min_p == 0.0 for p in params):
        return
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * _column([p.min_p for p in params], logits)
    logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Mask in place each row's tokens outside its top_k, then outside its top_p nucleus."""
    # Works on a stable descending sort, so among equal logits the lower token id ranks first.
    # top-k keeps the first k; top-p then keeps the shortest prefix whose (renormalized)
    # probability reaches top_p: probs [.5, .3, .2], top_p .7 -> [.5, .3].
    vocab_size = logits.shape[1]
    top_ks = _top_ks(params, vocab_size)
    top_ps = [p.top_p for p in params]
    if all(k == vocab_size for k in top_ks) and all(p >= 1.0 for p in top_ps):
        return
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab_size, device=logits.device)
    drop = positions >= _index(top_ks, logits.device).unsqueeze(1)
    if any(p < 1.0 for p in top_ps):
        drop |= _outside_nucleus(sorted_logits.masked_fill(drop, _NEG_INF).softmax(dim=-1), top_ps)
    logits.masked_fill_(torch.empty_like(drop).scatter_(1, order, drop), _NEG_INF)


# Tokens a block of _draw's cumulative sums: fp32 within one, float64 across them.
CDF_BLOCK = 256

# How many of a row's likeliest tokens the sampler looks among for a nucleus (top_p without top_k), in turn, before
# it sorts the vocabulary: 64 rows of 49152 logits, two cores: topk 257 ~5 ms, 4097 ~16, the stable sort ~120.
NUCLEUS_CANDIDATES = (256, 4096)


def top_k_top_p_candidates(logits: torch.Tensor, params: list[SamplingParams],
                           nucleus: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What apply_top_k_top_p keeps, from each row's K likeliest tokens instead of a sort of the vocabulary (64 x
    49152 logits: topk of 21 about 2 ms against 100 for the stable sort, two cores): (values, token ids) [rows, K],
    best first with ties to the lower id, the values outside the row's top_k and top_p -inf. K is the largest top_k,
    or `nucleus` for a row with top_p alone. None where the K cannot tell: a tie across the K-th place, or a
    row whose nucleus is larger than its K."""
    vocab_size = logits.shape[1]
    top_ks = _top_ks(params, vocab_size)
    k = max(top_k if top_k < vocab_size else nucleus for top_k in top_ks)
    if k >= vocab_size:
        return None
    values, token_ids = logits.topk(k + 1, dim=-1)
    if bool(((values[:, k - 1] == values[:, k]) & (values[:, k] > _NEG_INF)).any()):
        return None  # which of the tied tokens make the K is topk's choice, not the lower ids
    values, token_ids = values[:, :k], token_ids[:, :k]
    if k > 1 and bool((values[:, 1:] == values[:, :-1]).any()):  # ties to the lower id: by id, then by value, stable
        order = token_ids.argsort(dim=-1)
        values, token_ids = values.gather(1, order), token_ids.gather(1, order)
        order = values.argsort(dim=-1, descending=True, stable=True)
        values, token_ids = values.gather(1, order), token_ids.gather(1, order)
    device = logits.device
    drop = torch.arange(k, device=device) >= _index([min(top_k, k) for top_k in top_ks], device).unsqueeze(1)
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        probs = values.masked_fill(drop, _NEG_INF).softmax(dim=-1)  # renormalized over the row's top_k
        alone = [i for i, (top_k, top_p) in enumerate(zip(top_ks, top_ps)) if top_k == vocab_size and top_p < 1.0]
        if alone:  # top_p alone: the probabilities over the whole vocabulary, whose nucleus must lie in the K
            index = _index(alone, device)
            whole = (values[index] - logits[index].logsumexp(dim=-1, keepdim=True)).exp()
            if bool((whole.sum(dim=-1) < _column([top_ps[i] for i in alone], whole).squeeze(1)).any()):
                return None
            probs[index] = whole
        drop |= _outside_nucleus(probs, top_ps)
    return values.masked_fill_(drop, _NEG_INF), token_ids


def _top_ks(params: list[SamplingParams], vocab_size: int) -> list[int]:
    """Each row's top_k, the vocabulary size where it keeps every token (0, -1 or past it)."""
    return [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]


def _outside_nucleus(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Of probabilities sorted best first, the places past each row's nucleus: the tokens whose predecessors already
    reach top_p (none where top_p is 1)."""
    before = torch.zeros_like(probs)
    before[:, 1:] = probs.cumsum(dim=-1)[:, :-1]
    top_p = _column(top_ps, probs)
    return (before >= top_p) & (top_p < 1.0)


def _by_part(logits: torch.Tensor, rows: list[SamplingRow], chosen: list[int], sample_chosen,
             sample_rest) -> torch.Tensor:
    """sample_chosen(logits, rows) over the rows listed in `chosen`, sample_rest over the others, in row order; a part
    that holds every row runs on `logits` itself (no copy of its rows)."""
    if len(chosen) == len(rows):
        return sample_chosen(logits, rows)
    if not chosen:
        return sample_rest(logits, rows)
    sampled = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    rest = sorted(set(range(len(rows))) - set(chosen))
    for part, sample in ((chosen, sample_chosen), (rest, sample_rest)):
        index = _index(part, logits.device)
        sampled[index] = sample(logits[index], [rows[i] for i in part])
    return sampled


def _exponential(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """out filled with Exp(1) draws, -log U for uniform U (64 x 49152 on two cores: ~9 ms, against ~50 for torch's
    exponential_)."""
    return out.uniform_(generator=generator).log_().neg_()


def _raw_logprobs(logits: torch.Tensor,
                  rows: list[SamplingRow]) -> tuple[list[int], torch.Tensor] | None:
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return None
    chosen = logits if len(wanted) == len(rows) else logits[_index(wanted, logits.device)]
    return wanted, chosen.float().log_softmax(dim=-1)


def _gather_logprobs(raw: tuple[list[int], torch.Tensor] | None, sampled: list[int],
                     rows: list[SamplingRow]) -> list[LogprobsRow | None]:
    out: list[LogprobsRow | None] = [None] * len(rows)
    if raw is None:
        return out
    wanted, logprobs = raw
    gathered = token_logprobs(logprobs, [sampled[i] for i in wanted], [rows[i].params.logprobs for i in wanted])
    for i, row in zip(wanted, gathered):
        out[i] = row
    return out


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], requested: list[int]) -> list[LogprobsRow]:
    """Each row's LogprobsRow from `logprobs` [rows, vocab] (log-softmaxed, fp32): the logprob and rank of its token
    in `token_ids` (the sampled one, or the prompt's next token), then its top `requested` (-1: whole vocabulary)."""
    vocab_size = logprobs.shape[1]
    ks = [_num_logprobs(k, vocab_size) for k in requested]
    ids = _index(token_ids, logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)
    # vLLM's rank: how many tokens have a logprob >= the chosen one's (ties take the worse rank).
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    top_values, top_ids = logprobs.topk(max(ks), dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    chosen = chosen.squeeze(1).tolist()
    return [LogprobsRow(token_ids=[token_ids[j]] + top_ids[j][:k], logprobs=[chosen[j]] + top_values[j][:k],
                        ranks=[ranks[j]] + list(range(1, k + 1))) for j, k in enumerate(ks)]


def _num_logprobs(requested: int, vocab_size: int) -> int:
    # -1 asks for the whole vocabulary.
    return vocab_size if requested == -1 else min(requested, vocab_size)


def plain_greedy_without_logprobs(rows: Sequence[SamplingRow]) -> bool:
    """Whether every row takes the argmax of its raw logits and returns no logprobs: all the sampler would do with the
    logits is argmax_rows, which the lm_head's fused argmax gives without them (ModelRunner.execute)."""
    return all(_is_plain_greedy(row) and row.params.logprobs is None for row in rows)


def _is_plain_greedy(row: SamplingRow) -> bool:
    params = row.params
    return (params.is_greedy and not _has_penalty(params) and not params.logit_bias
            and params.allowed_token_ids is None and not _min_tokens_banned(row) and not _bad_words_banned(row)
            and (row.grammar is None or not row.grammar.active))


def _has_penalty(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


def _token_counts(seqs: list[Sequence[int]], vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    # [n, vocab] float counts; ragged rows are padded with the spare id `vocab_size`, then cut off.
    counts = torch.zeros((len(seqs), vocab_size + 1), dtype=like.dtype, device=like.device)
    width = max(len(s) for s in seqs)
    if width:
        padded = [list(s) + [vocab_size] * (width - len(s)) for s in seqs]
        ids = _index(padded, like.device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=like.dtype, device=like.device))
    return counts[:, :vocab_size]


def _row_generator(row: SamplingRow, device: torch.device) -> torch.Generator:
    # Seeded by (seed, step): the same seed draws the same tokens in any batch and after a
    # preemption recomputes the request, since step = len(output_token_ids) is the same again.
    generator = torch.Generator(device=device)
    generator.manual_seed(_mix_seed(row.params.seed, len(row.output_token_ids)))
    return generator


def _mix_seed(seed: int, step: int) -> int:
    # splitmix64 of (seed, step): neighbouring seeds and steps give unrelated streams.
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _index(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)
