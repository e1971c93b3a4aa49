"""Prompts prefilled together (``DecoderRows.prefill_many``, issue 61 item 1): each prompt's
state and logits are the bits of its prefill alone, prompts of every length mixed in one call
(with and without a prefix cache), and a burst of prompts of one length is one call."""

from __future__ import annotations

import random

import torch

from fastrwa.models import PackedLM
from fastrwa.serve.prefix_cache import PrefixCache
from fastrwa.serve.rows import DecoderRows


class Counting:
    """A decoder that counts its calls of ``extend`` and ``prefill`` (what it wraps does
    the work)."""

    def __init__(self, decoder):
        self.inner, self.calls = decoder, []
        self.kind = decoder.kind

    def extend(self, tokens, cache):
        self.calls.append(tuple(tokens.shape))
        return self.inner.extend(tokens, cache)

    def prefill(self, tokens, cache):
        self.calls.append(("prefill", *tokens.shape))
        return self.inner.prefill(tokens, cache)

    def step_(self, token, cache, *, rows=None):
        self.calls.append("step")
        return self.inner.step_(token, cache, rows=rows)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _prompts(rng: random.Random, n: int) -> list:
    base = bytes(rng.randrange(256) for _ in range(700))
    out = []
    for _ in range(n):
        length = rng.choice([1, 2, 7, 16, 255, 256, 257, 600])
        start = rng.choice([0, 0, 3])
        out.append(base[start:start + length])
    return out


def test_prompts_staged_together_are_each_alone(tiny_model):
    packed = PackedLM(tiny_model)
    rng = random.Random(0)
    for cache in (None, PrefixCache(1 << 24, every=64)):
        rows = DecoderRows(packed, 4, 256, cache)
        for _ in range(3):
            prompts = _prompts(rng, rng.randrange(2, 9))
            rows.prefill_many([torch.tensor([list(p)]) for p in prompts])
            for i, prompt in enumerate(prompts):
                alone = packed.allocate_cache(1)
                logits = packed.prefill(torch.tensor([list(prompt)]), alone)
                rows.select(i)
                assert torch.equal(rows.logits(), logits), (len(prompt), i)
                rows.place(3)
                for buf, one in zip(rows.cache.stacked, alone.stacked):
                    assert torch.equal(buf[:, 3], one[:, 0]), (len(prompt), i)


def test_a_burst_of_one_length_is_one_call(tiny_model):
    decoder = Counting(PackedLM(tiny_model))
    rows = DecoderRows(decoder, 64, 256)
    rows.prefill_many([torch.tensor([list(b"0123456789abcdef")])] * 64)
    assert decoder.calls == [(64, 16)]
    decoder.calls.clear()
    rows.prefill_many([torch.tensor([[1] * n]) for n in (5, 9, 9, 12)])
    assert decoder.calls == [(4, 5), (3, 4), (1, 3)]


def test_long_prompts_prefilled_over_steps_keep_their_bytes(tiny_model):
    """``prefill_chunk``: prompts longer than it are prefilled a chunk a step while the
    running streams decode (with and without a prefix cache); every stream's bytes are
    generate's, greedy and seeded, and the short streams are not held until a long prompt
    is in."""
    from fastrwa.serve.schema import Completion

    from .test_engine import run_checked

    packed = PackedLM(tiny_model)
    rng = random.Random(9)
    prompts = _prompts(rng, 12) + [bytes(rng.randrange(256) for _ in range(900))]
    requests = [Completion(prompt=p or b"x", max_tokens=rng.randrange(1, 30),
                           temperature=rng.choice([0.0, 0.9]), top_p=rng.choice([None, 0.8]),
                           seed=70 + i) for i, p in enumerate(prompts)]
    for cache in (None, PrefixCache(1 << 24, every=64)):
        decoder = Counting(packed)
        run_checked(tiny_model, decoder, packed, requests, 4, cache, prefill_chunk=32)
        pieces = [c for c in decoder.calls if c != "step"]
        assert max(shape[1] for shape in pieces) <= 32           # (never more a call)
        # (the long prompt's pieces come between the running streams' steps)
        calls = ["step" if c == "step" else c[1] for c in decoder.calls]
        assert any(calls[i:i + 3] == [32, "step", 32] for i in range(len(calls)))
