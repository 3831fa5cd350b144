"""The three model-level measurements of a cache, each one prompt at a time
as generation runs: the prompt is prefilled (attended exactly while the cache
compresses it), and every later token is one decode step that appends to the
cache and attends through it.

- perplexity: teacher-forced decode of a text's next tokens after a prefill;
- needle retrieval: a haystack prompt with one pass key, then the question
  decoded through the cache and the answer generated greedily;
- greedy generation, compared token by token with another cache's.

A prompt's forward pass attends exactly whatever the cache stores, so its
keys, values and last logits are the same for every cache: `prefill` runs it
once and `Prefill.fill` hands those keys and values to each cache as the
model's own forward pass would, layer by layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List

import torch

from .caches import CacheChoice
from .models import QualityModel
from .texts import NeedlePrompt


# Query rows of a prompt's last tokens kept per layer: what a
# `[cache.budget]` weighs the prompt's states by (it reads `observe` of them).
PROMPT_QUERY_ROWS = 128


@dataclass
class Prefill:
    """A prompt's forward pass: every layer's keys and values `[1, kv_heads,
    tokens, head_dim]` (post-RoPE, as a cache receives them), the queries of
    its last tokens `[1, q_heads, rows, head_dim]` (unit-scaled) and the
    logits of its last position."""

    kv: list
    logits: torch.Tensor
    queries: list

    @property
    def tokens(self) -> int:
        return self.kv[0][0].shape[-2]

    def fill(self, cache) -> None:
        """Gives `cache` the prompt, layer by layer, as the forward pass does."""
        for layer, (k, v) in enumerate(self.kv):
            cache.update(k, v, layer, {"kvcc_queries": self.queries[layer]})


def prefill(qm: QualityModel, ids: torch.Tensor) -> Prefill:
    """Runs the prompt `ids` `[1, tokens]` once, keeping every layer's keys
    and values whole (sliding-window layers too: each cache keeps of them
    what it keeps)."""
    from transformers import DynamicCache

    from ..hf import capture_queries

    cache = DynamicCache()
    with capture_queries(PROMPT_QUERY_ROWS) as queries:
        logits = qm.forward(ids, cache, last_only=True)[0, -1]
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    return Prefill(kv, logits, [queries.get(i) for i in range(len(kv))])


@dataclass
class Perplexity:
    """Teacher-forced decode of `len(nll)` tokens: each token's negative
    log-likelihood and the argmax prediction of every step."""

    nll: List[float]
    top1: List[int]

    @property
    def value(self) -> float:
        return math.exp(sum(self.nll) / len(self.nll))


def perplexity(
    qm: QualityModel, choice: CacheChoice, ids: torch.Tensor, prompt: Prefill, steps: int
) -> Perplexity:
    """After the prefill `prompt` of `ids`' first tokens, feeds the next ones
    one step at a time and scores the token after each: `steps` tokens, each
    predicted by a step that attended through the cache."""
    start = prompt.tokens
    if ids.shape[1] < start + steps + 1:
        raise ValueError(f"the text holds {ids.shape[1]} tokens, not {start + steps + 1}")
    qm.check_context(start + steps)
    cache = choice.open(qm, start + steps)
    prompt.fill(cache)
    nll, top1 = [], []
    for t in range(start, start + steps):
        logits = qm.forward(ids[:, t : t + 1], cache)[0, -1].float()
        target = int(ids[0, t + 1])
        nll.append(float(-torch.log_softmax(logits, -1)[target]))
        top1.append(int(logits.argmax()))
    return Perplexity(nll, top1)


def greedy(qm: QualityModel, cache, logits: torch.Tensor, tokens: int) -> List[int]:
    """`tokens` greedy tokens, the first chosen from `logits` (those of the
    last position already in `cache`)."""
    out = []
    for i in range(tokens):
        token = int(logits.argmax())
        out.append(token)
        if i + 1 < tokens:
            logits = qm.forward(torch.tensor([[token]], device=qm.device), cache)[0, -1]
    return out


@dataclass
class NeedleAnswer:
    length: int
    depth: float
    answer: str
    generated: str
    found: bool


def needle(
    qm: QualityModel,
    choice: CacheChoice,
    prompt: NeedlePrompt,
    haystack: Prefill,
    answer_tokens: int,
    cache=None,
    decode_question: bool = True,
) -> NeedleAnswer:
    """The haystack prefilled, the question decoded through the cache (one
    token per step; with `decode_question` False the haystack prefill holds
    it), then `answer_tokens` greedy tokens; found when they hold the pass
    key. `cache` (a kvcc cache this choice opened for as many tokens) is
    emptied and reused."""
    total = prompt.tokens + answer_tokens
    qm.check_context(total)
    cache = choice.open(qm, total, previous=cache)
    haystack.fill(cache)
    if decode_question:
        question = torch.tensor([prompt.question], device=qm.device)
        last = qm.forward(question, cache, last_only=True)[0, -1]
    else:
        last = haystack.logits
    text = qm.tokenizer.decode(greedy(qm, cache, last, answer_tokens))
    return NeedleAnswer(total, prompt.depth, prompt.answer, text, prompt.answer in text)


@dataclass
class Agreement:
    """Greedy tokens of a cache against a reference's: the share of equal
    positions and the first position where they differ (`tokens` if none)."""

    tokens: int
    equal: int
    first_difference: int

    @property
    def rate(self) -> float:
        return self.equal / self.tokens


def agreement(reference: List[int], tokens: List[int]) -> Agreement:
    first = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), len(tokens))
    equal = sum(a == b for a, b in zip(reference, tokens))
    return Agreement(len(tokens), equal, first)


def generation(qm: QualityModel, choice: CacheChoice, prompt: Prefill, tokens: int) -> List[int]:
    """`tokens` greedy tokens after the prefill `prompt`, through a fresh cache."""
    qm.check_context(prompt.tokens + tokens)
    cache = choice.open(qm, prompt.tokens + tokens)
    prompt.fill(cache)
    return greedy(qm, cache, prompt.logits, tokens)
