"""Plain-torch references of sampling: the counter-hash uniforms, the token draw, speculative acceptance, and
the fixed-shape speculative step's carry (what it leaves for the next step of the same sequences, and how
that step reads it).

Part of `dsv4.ops.reference` (which re-exports every name here): the definitions that the fused sampling
backends are tested against. Every random number is a pure function of (seed, counter, column, stream),
so a row's draw does not depend on the rest of its batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # a 27-bit odd multiplier: x * _MIX stays below 2^59 in int64
_GOLDEN = 0x9E3779B1  # column stride of the counter hash
STREAM_SAMPLE = 0x2545F491  # separate streams: the token draw, speculative acceptance, the draft's draw
STREAM_ACCEPT = 0x1B873593
STREAM_DRAFT = 0x68E31DA4


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values in [0, 2^32)."""
    x = ((x ^ (x >> 16)) * _MIX) & _MASK32
    x = ((x ^ (x >> 16)) * _MIX) & _MASK32
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, counter: torch.Tensor, stream: int) -> torch.Tensor:
    """[B] int64 keys in [0, 2^32) of (seed, counter, stream): the low and high words of the seed and the
    low word of the counter, mixed."""
    s_lo, s_hi = seed & _MASK32, (seed >> 32) & _MASK32
    key = _hash32(_hash32(s_lo ^ stream) ^ s_hi)
    return _hash32(key ^ (counter & _MASK32))


def uniform(seed: torch.Tensor, counter: torch.Tensor, n: int, stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """[B, n] float64 uniforms in (0, 1), a pure function of (seed [B], counter [B], column, stream).

    seed and counter are int64; only their low 32 bits (seed: low and high words) are used.
    """
    key = row_keys(seed, counter, stream)  # [B]
    cols = torch.arange(n, device=seed.device, dtype=torch.int64)
    x = _hash32((key.unsqueeze(1) + cols * _GOLDEN) & _MASK32)  # [B, n]
    return (x.double() + 0.5) / 2.0**32


def gumbel_noise(seed: torch.Tensor, counter: torch.Tensor, n: int, stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """[B, n] float64 Gumbel noise -log(-log(u)) of the counter-hash uniforms (`uniform`)."""
    return -torch.log(-torch.log(uniform(seed, counter, n, stream)))


def gumbel_argmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    stream: int = STREAM_SAMPLE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits [B, V], and its log-probability under the model.

    Row b draws argmax(logits / temperature[b] + Gumbel noise) in float64, the noise -log(-log(u)) of the
    counter-hash uniforms of (seeds[b], counters[b], stream): an exact draw from softmax(logits / T). A
    greedy[b] row takes argmax(logits) instead. Ties go to the lowest index, and a NaN wins over every
    number (as torch.argmax). temperature [B] float64 (> 0), greedy [B] bool, seeds / counters [B] int64.
    Returns (tokens [B] int64, log p(token) [B] float32: logit - logsumexp(logits) in float64)."""
    x = logits.double()
    noise = gumbel_noise(seeds, counters, x.size(-1), stream)
    choice = torch.where(greedy.unsqueeze(1), x, x / temperature.unsqueeze(1) + noise).argmax(-1)  # [B]
    lse = torch.logsumexp(x, -1)  # [B]
    return choice, (x.gather(1, choice.unsqueeze(1)).squeeze(1) - lse).float()


def temperature_distribution(
    x: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    filtered=None,
) -> torch.Tensor:
    """The distribution a row samples from: x [..., V] float64 logits, temperature [..., 1] (1 for greedy
    rows), greedy [..., 1] bool -> softmax(x / T) (after `filtered`, a top-k / top-p / min-p mask of the
    scaled logits), or the one-hot of the argmax for a greedy row; float64, with no host synchronization."""
    scaled = x / temperature
    if filtered is not None:
        scaled = filtered(scaled)
    probs = scaled.softmax(-1)
    onehot = F.one_hot(x.argmax(-1), x.size(-1)).to(probs.dtype)
    return torch.where(greedy, onehot, probs)


def rejection_sample(
    target: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor,
    n_drafts: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative acceptance by rejection sampling for B rows of up to K drafts.

    Draft i is kept with probability min(1, p_i(d_i) / q_i(d_i)) (the test u * q <= p, u the uniform of
    (seed, counter + i, STREAM_ACCEPT)); at the first rejection the next token is drawn from normalize(max(p -
    q, 0)), after the row's last draft from p (the bonus), with the token draw of (seed, counter + accepted,
    STREAM_SAMPLE): the emitted tokens follow the target distribution whatever the drafts. target [B, K + 1,
    V]: p at each verified position (float64, rows summing to 1); draft_probs [B, K, V]: q of each draft;
    drafts [B, K]; n_drafts [B] (row b's drafts are the first n_drafts[b]); counters [B]: the sequence index
    of the token each row's first draft proposes. -> (accepted [B], the next token [B])."""
    B, K1, V = target.shape
    K = K1 - 1
    dev = target.device
    if K:
        i = torch.arange(K, device=dev)
        p_d = target[:, :K].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, K]
        q_d = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, K]
        flat = (counters.unsqueeze(1) + i).flatten()  # every row's K tests in one call (a per-row function)
        u = uniform(seeds.repeat_interleave(K), flat, 1, STREAM_ACCEPT).view(B, K)  # [B, K]
        ok = (u * q_d <= p_d) & (i.unsqueeze(0) < n_drafts.unsqueeze(1))
        accepted = ok.long().cumprod(1).sum(1)  # [B]
    else:
        accepted = torch.zeros(B, dtype=torch.long, device=dev)
    rows = torch.arange(B, device=dev)
    p = target[rows, accepted]  # [B, V]
    q = torch.cat([draft_probs, torch.zeros(B, 1, V, dtype=draft_probs.dtype, device=dev)], 1)[rows, accepted]
    q = torch.where((accepted < n_drafts).unsqueeze(1), q, 0)  # after the last draft: the bonus, from p
    residual = (p - q).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-300), p)
    # the draw from residual: Gumbel-max over its logarithms at temperature 1
    one = torch.ones(B, dtype=torch.float64, device=dev)
    every = torch.zeros(B, dtype=torch.bool, device=dev)
    return accepted, gumbel_argmax(torch.log(residual), one, every, seeds, counters + accepted, STREAM_SAMPLE)[0]


def speculative_accept(
    logits: torch.Tensor,
    draft_logits: torch.Tensor,
    drafts: torch.Tensor,
    n_drafts: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    draft_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify step's acceptance from logits: the target p_i = softmax(logits[:, i] / T) and each draft's q_i
    = softmax(draft_logits[:, i] / T) in float64 (`temperature_distribution`; for a greedy row p is the
    one-hot of the argmax and q the one-hot of the draft), then `rejection_sample`. A row without drafts
    (n_drafts 0) draws its token as a plain decode row does: `gumbel_argmax` of logits[:, 0] at its
    temperature on (seed, counter, STREAM_SAMPLE).

    logits [B, K + 1, V] (any float dtype), draft_logits [B, K, V] (the logits that drew each draft), drafts
    [B, K] int64, n_drafts [B] int64 in [0, K], temperature [B] float64 (1 for greedy rows), greedy [B] bool,
    seeds / counters [B] int64 (counter: the sequence index of the first draft's token). draft_rows [B] int64
    (optional): draft_logits is then a store [R, >= K, V] and row b's drafts were drawn from
    draft_logits[draft_rows[b], :K] (a fused backend reads them there instead of a gathered copy). ->
    (accepted [B], next token [B]), int64."""
    B, K1, V = logits.shape
    if draft_rows is not None:
        draft_logits = draft_logits[draft_rows, : K1 - 1]
    temp, flag = temperature.view(B, 1, 1), greedy.view(B, 1, 1)
    target = temperature_distribution(logits.double(), temp, flag)  # [B, K + 1, V]
    q = temperature_distribution(draft_logits.double(), temp, flag)  # [B, K, V]
    q = torch.where(flag, F.one_hot(drafts, V).double(), q)
    accepted, bonus = rejection_sample(target, q, drafts, n_drafts, seeds, counters)
    plain, _ = gumbel_argmax(logits[:, 0], temperature, greedy, seeds, counters)
    return accepted, torch.where(n_drafts == 0, plain, bonus)


def write_carry(
    carry: torch.Tensor,
    ints: torch.Tensor,
    generated: torch.Tensor,
    cap: torch.Tensor,
    accepted: torch.Tensor,
    bonus: torch.Tensor,
    drafts: torch.Tensor,
    last_position: int,
) -> None:
    """In place, after a fixed-shape speculative step of B rows with w drafts each: carry[table row] = the
    integers the host would give each row's next step, [w + 4] = its last token (the bonus) and drafts
    (zeros past its own), its drafts' count, start and tokens generated. A row keeps n = min(w, last_position
    - start, cap - generated) drafts, at least 0, as the engine's bookkeeping does; start = its step's start
    + accepted + 1, generated likewise.

    carry [R, w + 4] int64 with contiguous rows; ints [B, >= w + 4] int64 (`fixed_inputs`' columns: the
    start in column w + 2, the table row in column w + 3); generated, cap (max_tokens - 1), accepted, bonus
    [B] int64; drafts [B, w] int64. Rows naming the same table row (padding) leave one of their writes."""
    w = drafts.size(1)
    start = ints[:, w + 2] + accepted + 1
    generated = generated + accepted + 1
    n = torch.minimum(last_position - start, cap - generated).clamp(min=0, max=w)
    tokens = torch.cat([bonus.unsqueeze(1), drafts], 1)  # [B, w + 1]
    tokens = tokens.masked_fill(torch.arange(w + 1, device=tokens.device) > n.unsqueeze(1), 0)
    carry[ints[:, w + 3]] = torch.cat([tokens, n.unsqueeze(1), start.unsqueeze(1), generated.unsqueeze(1)], 1)


def spec_advance(
    accepted: torch.Tensor,
    bonus: torch.Tensor,
    drafts: torch.Tensor,
    start: torch.Tensor,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What a fixed-shape speculative step of B rows with w drafts each derives from its acceptance, before the
    MTP block catches up and drafts again.

    accepted, bonus, start [B] int64 (start: the position of each row's first verified token); drafts [B, w]
    int64 (any strides); counters [B] int64, the tokens each row generated before the step, or None.
    -> (nxt [B, w + 1]: the token after each verified position, draft i + 1 while i < accepted, then the bonus;
    out [B]: the flat index of each row's last accepted position in the step's B rows of w + 1 tokens, b (w +
    1) + accepted; positions [w + 1, B]: start + accepted + 1 + j in row j, the position of the next step's
    j-th token (the bonus, then the next drafts); indices [w, B]: counters + accepted + 1 + j in row j, the
    sequence index of next draft j, None without counters). Each row of positions and indices is contiguous."""
    B, w = drafts.shape
    j = torch.arange(w + 1, device=drafts.device)
    shifted = torch.cat([drafts, bonus.unsqueeze(1)], 1)  # [B, w + 1]
    nxt = torch.where(j.unsqueeze(0) < accepted.unsqueeze(1), shifted, bonus.unsqueeze(1))
    out = torch.arange(B, device=drafts.device) * (w + 1) + accepted
    step = accepted + 1
    positions = (start + step).unsqueeze(0) + j.unsqueeze(1)  # [w + 1, B]
    indices = None if counters is None else (counters + step).unsqueeze(0) + j[:w].unsqueeze(1)  # [w, B]
    return nxt, out, positions, indices


def read_carry(
    ints: torch.Tensor, carry: torch.Tensor, tables_w: torch.Tensor, tables_c: torch.Tensor, pad_row: int
) -> tuple[torch.Tensor, ...]:
    """Before a fixed-shape speculative step of B rows with w drafts each: its integers with the fed rows' taken
    from the carry the last step left (`write_carry`), and its page tables gathered.

    ints [B, w + 4 + S + 3] int64 (S = 0, or 4 for a sampled step): per row its w + 1 tokens (last token and
    drafts), drafts' count, start, table row; with S = 4 its seed, tokens generated, greedy flag and the
    temperature's float64 bits; then whether the row is fed, its tokens generated, and max_tokens - 1. carry
    [R, w + 4] int64: per table row tokens, drafts' count, start, generated. tables_w / tables_c [R', P]
    int64: page tables by table row; pad_row: the padding rows' table row.
    -> (base [B, w + 4 + S]: ints' first columns, a fed row's first w + 3 from carry[table row] and with S =
    4 its generated count too; generated [B] (a fed row's from the carry); max_tokens - 1 [B]; the page
    tables' rows wtable, ctable [B, P]; state [B]: the table row, 0 for padding rows)."""
    w = carry.size(1) - 4
    base, flag, generated, cap = ints[:, :-3], ints[:, -3], ints[:, -2], ints[:, -1]
    sampled = base.size(1) == w + 8
    c = carry[base[:, w + 3]]  # [B, w + 4]: tokens, n_drafts, start, generated
    fed = flag > 0
    generated = torch.where(fed, c[:, w + 3], generated)
    parts = [torch.where(fed.unsqueeze(1), c[:, : w + 3], base[:, : w + 3]), base[:, w + 3 : w + 4]]
    if sampled:  # seed, generated, greedy, temperature
        parts += [base[:, w + 4 : w + 5], generated.unsqueeze(1), base[:, w + 6 :]]
    trow = base[:, w + 3]
    state = trow.masked_fill(trow == pad_row, 0)
    return torch.cat(parts, 1), generated, cap, tables_w[trow], tables_c[trow], state


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) of each row: logits [N, V] (any float dtype), tokens [N] int64 -> [N] float64, logit -
    logsumexp(logits) in float64 (torch's logsumexp: a row of -inf gives -inf, a token's -inf logit there
    NaN; a NaN logit makes its row NaN)."""
    x = logits.double()
    return x.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(x, -1)
