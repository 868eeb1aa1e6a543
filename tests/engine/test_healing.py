"""Token healing with the shipped tokenizer and model: where a prompt is cut, what the first tokens may be,
and that the engine keeps to it (`dsv4.engine.healing`).

Oracles: the tokenizer itself (a token's bytes against its decoding; a prompt's text against the healed
prompt's tokens plus the removed text), a brute-force scan of the vocabulary for the allowed sets, the
full-sequence forward for the log-probabilities of a healed token, and the same prompts run with healing
off (a prompt that ends where the tokenizer would not merge gets the same tokens).
"""

from __future__ import annotations

import json
import random
import textwrap

import pytest
import torch

from dsv4.checkpoint import load_pretrained
from dsv4.cli import main
from dsv4.engine import Engine, EngineConfig, SamplingParams
from dsv4.engine.healing import MAX_HEALED_BYTES, MAX_HEALED_TOKENS, Healed, Vocabulary, heal
from dsv4.engine.offline import complete, generate
from dsv4.loading import default_model_dir
from dsv4.ops.precision import exact_accumulation
from dsv4.tokenizer import ByteTokenizer, Tokenizer

GCD = 'def gcd(a, b):\n    """Greatest common divisor by Euclid\'s algorithm."""\n'


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(default_model_dir())


@pytest.fixture(scope="module")
def vocab(tok) -> Vocabulary:
    return Vocabulary.of(tok)


@pytest.fixture(scope="module")
def model():
    return load_pretrained(default_model_dir(), progress=False).eval()


def random_prompts(n: int, seed: int) -> list[str]:
    """Python source cut at random characters (mid-word, after a space, after a newline, ...)."""
    source = open(textwrap.__file__, encoding="utf-8").read()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(source) - 400)
        out.append(source[start : start + rng.randrange(20, 300)])
    return out


def _bytes(vocab: Vocabulary, ids: list[int]) -> bytes:
    return b"".join(vocab.piece(i) for i in ids)


# ------------------------------------------------------------------------------------------ the vocabulary
def test_token_bytes_are_what_the_tokenizer_decodes(tok, vocab):
    assert len(vocab) == tok.vocab_size and vocab.merges
    assert vocab.piece(tok.bos_id) == vocab.piece(tok.eos_id) == b""
    for i, piece in enumerate(vocab.pieces):
        if i not in (tok.bos_id, tok.eos_id):
            assert piece, i  # every other token stands for some bytes
            text = piece.decode("utf-8", errors="replace")
            assert "\ufffd" in text or text == tok.decode([i]), i
    for text in random_prompts(20, seed=0) + ["héllo wörld → ✓"]:
        assert _bytes(vocab, tok.encode(text)) == text.encode("utf-8")


def test_a_byte_tokenizer_never_heals():
    bt = ByteTokenizer(0, 1)
    v = Vocabulary.of(bt)
    assert not v.merges
    for text in ["def f(x):\n", "half a wo", "trailing space "]:
        ids = bt.encode(text, bos=True)
        assert heal(v, ids) == Healed(ids)


# ------------------------------------------------------------------------------------------ where to cut
def test_the_issue_prompt_backs_up_its_newline(tok, vocab):
    ids = tok.encode(GCD, bos=True)
    h = heal(vocab, ids)
    assert h.text == "\n" and h.removed == 1 and h.prompt == ids[:-1]
    assert vocab.extendable(b"\n")  # "\n   " (newline + indentation) is a token


def test_a_prompt_ending_mid_word_backs_up_the_word_piece(tok, vocab):
    prompt = "def greatest_common_divi"
    h = heal(vocab, tok.encode(prompt, bos=True))
    assert h.removed >= 1 and h.text and prompt.endswith(h.text)
    assert vocab.extendable(h.text.encode())


def test_cuts_of_random_prompts(tok, vocab):
    """The healed prompt plus the removed text is the prompt; the removed text is the longest run of final
    tokens (at most MAX_HEALED_TOKENS) that some longer token starts with; nothing is removed where the
    last token starts no longer token."""
    healed = 0
    for text in random_prompts(200, seed=1):
        ids = tok.encode(text, bos=True)
        h = heal(vocab, ids)
        assert h.prompt == ids[: len(ids) - h.removed] and h.prompt
        assert _bytes(vocab, h.prompt) + h.text.encode() == text.encode()
        if h.removed == 0:
            assert not vocab.extendable(vocab.piece(ids[-1]))
            continue
        healed += 1
        assert h.removed <= MAX_HEALED_TOKENS and vocab.extendable(h.text.encode())
        longer = _bytes(vocab, ids[len(ids) - h.removed - 1 :])
        assert (
            h.removed == MAX_HEALED_TOKENS
            or not vocab.extendable(longer)
            or len(h.prompt) == 1
            or longer[0] & 0xC0 == 0x80
            or len(longer) > MAX_HEALED_BYTES
        )
    assert 20 < healed < 200  # both kinds of ending occur
    unicode = "naïve = 'café'  # → über ✓ 日本語のテキスト"
    for end in range(1, len(unicode) + 1):  # cut at every character, across multi-byte tokens
        h = heal(vocab, tok.encode(unicode[:end], bos=True))
        assert tok.decode(h.prompt) + h.text == unicode[:end]  # the kept tokens end on a whole character


def test_allowed_sets_are_every_spelling_of_what_is_left(vocab, tok):
    """allowed(rest) against a scan of the vocabulary: tokens starting with rest, or proper prefixes of it
    (each single byte is a token, so every remainder can be spelled); any walk of allowed draws ends
    the constraint with the removed bytes spelled exactly."""
    rng = random.Random(2)
    rests = {b"\n", b" ", b"\n    ", b"divi"}
    rests |= {heal(vocab, tok.encode(t, bos=True)).text.encode() for t in random_prompts(60, seed=3)} - {b""}
    for rest in sorted(rests):
        want = sorted(i for i, p in enumerate(vocab.pieces) if p and (p.startswith(rest) or rest.startswith(p)))
        assert vocab.allowed(rest).tolist() == want, rest
        for _ in range(5):  # random walks of allowed draws
            left, spelled = rest, b""
            while left:
                t = int(rng.choice(vocab.allowed(left)))
                spelled += vocab.piece(t)
                left = vocab.advance(left, t)
            assert spelled.startswith(rest)


# ------------------------------------------------------------------------------------------ the engine
def test_the_issue_prompt_gets_an_indented_body(model, tok):
    """Greedy, the shipped model: the function goes on with an indented line (without healing it sees the
    lone newline token and takes the function as over)."""
    (c,) = complete(model, tok, [GCD], max_new_tokens=6)
    assert c.healed_text == "\n"
    first = c.text.split("\n")[0]
    assert first.startswith("    ") and first.strip(), c.text
    assert tok.decode(c.prompt + c.tokens) == GCD + c.text


@pytest.mark.parametrize("mode", ["greedy", "sampled", "sampled-bucketed"])
def test_the_constraint_holds_on_random_prompts(model, tok, vocab, mode):
    """Every healed prompt's first tokens spell the removed text (sampled at temperature 2, a free draw
    would rarely do so), on the ragged steps and on bucketed, overlapped ones (where unconstrained rows
    take the plain draw and constrained rows the eager sampler, and a constrained row's step waits for its
    last token), and prompt + completion is the healed text."""
    prompts = [p for p in random_prompts(40, seed=4) if heal(vocab, tok.encode(p, bos=True)).removed][:6]
    kw = dict(max_new_tokens=3, temperature=0.0 if mode == "greedy" else 2.0, seed=7)
    if mode == "sampled-bucketed":
        kw["engine_config"] = EngineConfig(
            max_seqs=8, max_model_len=512, pad_steps=True, prefix_caching=False, overlap=True
        )  # (and steps launched before the last is read)
    outs = complete(model, tok, prompts + ["def fibonacci(n):"], **kw)
    for p, c in zip(prompts, outs):
        removed, got = c.healed_text.encode(), _bytes(vocab, c.tokens)
        assert got.startswith(removed) or (len(c.tokens) == 3 and removed.startswith(got)), (p, removed, got)
        assert tok.decode(c.prompt + c.tokens) == p + c.text or not got.startswith(removed)


def _clean_prompt(tok, vocab) -> str:
    """A prompt whose last token starts no longer token."""
    for p in ["def fibonacci(n):", "x = f(a)", "print('done')", "return {}", "pass  # ok)"]:
        if heal(vocab, tok.encode(p, bos=True)).removed == 0:
            return p
    raise AssertionError("no clean prompt among the candidates")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_prompt_on_a_clean_boundary_gets_the_same_tokens(model, tok, vocab, temperature):
    """Healing on and off give the same tokens for a prompt that ends where the tokenizer would not merge,
    also batched beside a healed prompt (deterministic mode: rows do not affect each other)."""
    clean = _clean_prompt(tok, vocab)
    ids = tok.encode(clean, bos=True)
    kw = dict(max_new_tokens=6, temperature=temperature, seed=11, deterministic=True)
    off = generate(model, [ids], **kw)[0]
    assert generate(model, [ids], tokenizer=tok, **kw)[0] == off
    both = generate(model, [ids, tok.encode(GCD, bos=True)], tokenizer=tok, **kw)
    assert both[0] == off


def test_a_healed_tokens_logprob_is_renormalized_over_the_allowed_tokens(model, tok, vocab):
    """Greedy with logprobs: the first token is the most likely allowed one, its log-probability and
    alternatives those of the full forward's distribution restricted to the allowed tokens."""
    h = heal(vocab, tok.encode(GCD, bos=True))
    engine = Engine(model, EngineConfig(max_seqs=2, max_model_len=256, deterministic=True), tokenizer=tok)
    engine.add_request("a", h.prompt, SamplingParams(max_tokens=2, temperature=0, logprobs=3, heal_text=h.text))
    lps = []
    while engine.has_work():
        for out in engine.step():
            lps += out.new_logprobs
    with exact_accumulation(True), torch.no_grad():
        logits = model(torch.tensor([h.prompt])).logits[0, -1].double()
    allowed = torch.from_numpy(vocab.allowed(b"\n"))
    ref = torch.full_like(logits, float("-inf"))
    ref[allowed] = torch.log_softmax(logits[allowed], -1)
    first = lps[0]
    assert first.token in allowed.tolist() and first.token == int(ref.argmax())
    assert abs(first.logprob - float(ref[first.token])) < 1e-4  # fp32 logits, a few ulps apart
    assert [t for t, _ in first.top] == ref.topk(3).indices.tolist()
    assert all(abs(v - float(ref[t])) < 1e-4 for t, v in first.top)


def test_stop_strings_see_the_completion_not_the_removed_text(model, tok):
    """stop="\\n" on the issue prompt: the re-spelled newline is the prompt's, so the text is the first
    line of the body, not empty."""
    h = heal(Vocabulary.of(tok), tok.encode(GCD, bos=True))
    engine = Engine(model, EngineConfig(max_seqs=2, max_model_len=256), tokenizer=tok)
    engine.add_request("a", h.prompt, SamplingParams(max_tokens=12, temperature=0, stop=["\n"], heal_text=h.text))
    text, reason = "", None
    while engine.has_work():
        for out in engine.step():
            text += out.text
            reason = out.finish_reason or reason
    assert text.startswith("    ") and text.strip() and "\n" not in text
    assert reason in ("stop", "length")


def test_speculative_decoding_keeps_the_constraint_and_the_greedy_tokens(model, tok):
    """With MTP drafts (no drafts while the constraint lasts), greedy tokens equal plain decoding's."""
    prompts = [GCD, "def greatest_common_divi", "for i in range(10): "]
    plain = complete(model, tok, prompts, max_new_tokens=5, deterministic=True)
    spec = complete(model, tok, prompts, max_new_tokens=5, deterministic=True, speculative=2)
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    assert all(c.healed_text for c in plain)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_healing_keeps_a_padded_speculative_engine_on_its_fixed_shapes(model, tok, vocab, temperature):
    """Padded (as on a GPU, where each shape is a CUDA graph), a speculative engine draws a healing row in
    its bucketed step, under a mask the step itself applies: no step runs ragged (a new shape, eager, on a
    GPU), and the tokens are those of the eager speculative steps (greedy: plain decoding's too)."""
    prompts = [GCD, "def greatest_common_divi", "for i in range(10): ", "import o"]
    healed = [heal(vocab, tok.encode(p, bos=True)) for p in prompts]
    assert all(h.text for h in healed)
    kw = dict(max_new_tokens=6, temperature=temperature, seed=5, tokenizer=tok)

    def engine(**config):
        cfg = EngineConfig(**{"max_seqs": 4, "max_model_len": 128, "deterministic": True, "speculative": 2, **config})
        return Engine(model, cfg, tokenizer=tok, detokenize=False)

    eager = generate(model, healed, engine=engine(), **kw)
    padded = engine(pad_steps=True)
    assert generate(model, healed, engine=padded, **kw) == eager
    r = padded.runner
    assert r.eager_steps == r.padded_steps > 0  # every step bucketed or fixed-shape: none ragged
    for h, out in zip(healed, eager):
        assert _bytes(vocab, out).startswith(h.text.encode())
    if temperature == 0:
        assert eager == generate(model, healed, deterministic=True, **kw)
    # more healing rows than a step draws in its graph (`Runner.heal_rows`): those steps run eagerly, the same tokens
    more = healed + [heal(vocab, tok.encode(p, bos=True)) for p in ("x = [1, 2", "while Tru")]
    assert all(h.text for h in more) and len(more) > padded.runner.heal_rows
    crowded = engine(pad_steps=True, max_seqs=6)
    assert generate(model, more, engine=crowded, **kw) == generate(model, more, engine=engine(max_seqs=6), **kw)
    assert crowded.runner.eager_steps > crowded.runner.padded_steps  # (some steps ragged: the crowded ones)


def test_generate_command_heals_text_prompts_unless_told_not_to(capsys):
    assert main(["generate", GCD, "--max-new-tokens", "4", "--json"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert on["healed_text"] == "\n" and on["text"].startswith("    ")
    assert main(["generate", GCD, "--max-new-tokens", "4", "--json", "--no-token-healing"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["healed_text"] == "" and off["prompt_ids"] == on["prompt_ids"] + [off["prompt_ids"][-1]]
