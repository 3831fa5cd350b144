"""The three model-level measurements of a cache, each one prompt at a time
as generation runs: the prompt is prefilled (attended exactly while the cache
compresses it), and every later token is one decode step that appends to the
cache and attends through it.

- perplexity: teacher-forced decode of a text's next tokens after a prefill;
- needle retrieval: a haystack prompt with one pass key, then the question
  decoded through the cache and the answer generated greedily;
- greedy generation, compared token by token with another cache's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .caches import CacheChoice
from .models import QualityModel
from .texts import NeedlePrompt


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
    qm: QualityModel, choice: CacheChoice, ids: torch.Tensor, prefill: int, steps: int, cache=None
) -> Perplexity:
    """Prefills `ids[:, :prefill]`, then feeds `ids[:, prefill + i]` one step at
    a time and scores the next token: `steps` tokens, each predicted by a
    step that attended through the cache."""
    if ids.shape[1] < prefill + steps + 1:
        raise ValueError(f"the text holds {ids.shape[1]} tokens, not {prefill + steps + 1}")
    qm.check_context(prefill + steps)
    cache = choice.open(qm, prefill + steps, previous=cache)
    qm.forward(ids[:, :prefill], cache)
    nll, top1 = [], []
    for t in range(prefill, prefill + steps):
        logits = qm.forward(ids[:, t : t + 1], cache)[0, -1].float()
        target = int(ids[0, t + 1])
        nll.append(float(-torch.log_softmax(logits, -1)[target]))
        top1.append(int(logits.argmax()))
    return Perplexity(nll, top1)


def greedy(qm: QualityModel, cache, ids: torch.Tensor, tokens: int, first_logits=None) -> List[int]:
    """`tokens` greedy tokens after `ids` (already in `cache` when
    `first_logits`, the logits of its last position, is given)."""
    logits = first_logits if first_logits is not None else qm.forward(ids, cache)[0, -1]
    out = []
    for i in range(tokens):
        token = int(logits.argmax())
        out.append(token)
        if i + 1 < tokens:
            step = torch.tensor([[token]], device=qm.device)
            logits = qm.forward(step, cache)[0, -1]
    return out


@dataclass
class NeedleAnswer:
    length: int
    depth: float
    answer: str
    generated: str
    found: bool


def needle(
    qm: QualityModel, choice: CacheChoice, prompt: NeedlePrompt, answer_tokens: int, cache=None
) -> NeedleAnswer:
    """The haystack prefilled, the question decoded through the cache (one
    token per step), then `answer_tokens` greedy tokens; found when they hold
    the pass key."""
    total = prompt.tokens + answer_tokens
    qm.check_context(total)
    cache = choice.open(qm, total, previous=cache)
    qm.forward(torch.tensor([prompt.ids], device=qm.device), cache)
    question = torch.tensor([prompt.question], device=qm.device)
    last = qm.forward(question, cache)[0, -1]
    tokens = greedy(qm, cache, question, answer_tokens, first_logits=last)
    text = qm.tokenizer.decode(tokens)
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


def generation(qm: QualityModel, choice: CacheChoice, ids: torch.Tensor, tokens: int) -> List[int]:
    """`tokens` greedy tokens after the prompt `ids` through a fresh cache."""
    qm.check_context(ids.shape[1] + tokens)
    cache = choice.open(qm, ids.shape[1] + tokens)
    return greedy(qm, cache, ids, tokens)


@dataclass
class Reference:
    """The reference cache's results a measured cache is compared with."""

    perplexity: Perplexity
    needles: List[NeedleAnswer] = field(default_factory=list)
    generated: Optional[List[int]] = None
