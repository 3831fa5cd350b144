"""The texts the quality measurements read: a shipped prose text (original
essays, no digits in it), and needle-in-a-haystack prompts built from it.

A haystack is the essays' sentences in a seeded order, as many as a context
needs (they repeat past the text's length); the needle is one sentence
holding a random five-digit pass key, placed at a sentence boundary at the
asked depth; the question after the haystack asks for the key. Every piece
is tokenized on its own and joined as token ids, so lengths and positions are
exact.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from importlib import resources
from typing import List

ESSAYS = "essays.txt"

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? Remember, the pass key is"


def essays() -> str:
    """The shipped text: original essays, separated by blank lines."""
    return resources.files(__package__).joinpath("texts").joinpath(ESSAYS).read_text(encoding="utf-8")


def sentences(text: str) -> List[str]:
    """The sentences of `text`'s paragraphs (titles dropped), each with its
    leading space, as they sit inside running text."""
    out = []
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = " ".join(paragraph.split())
        if not paragraph or not paragraph.endswith((".", "?", "!")):
            continue  # a title line
        out.extend(" " + s for s in re.split(r"(?<=[.?!])\s+", paragraph) if s)
    return out


@dataclass(frozen=True)
class NeedlePrompt:
    """A haystack prompt with its needle: `ids` end just before the question,
    `question` is its token ids, `answer` the pass key's digits."""

    ids: List[int]
    question: List[int]
    answer: str
    depth: float
    needle_at: int  # token index of the needle's first token

    @property
    def tokens(self) -> int:
        return len(self.ids) + len(self.question)


def needle_prompt(tokenizer, length: int, depth: float, seed: int) -> NeedlePrompt:
    """A prompt of `length` tokens (haystack, needle and question) whose needle
    starts at the sentence boundary nearest `depth` (0 = right after the
    introduction, 1 = right before the question)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} is not in 0 ... 1")
    rng = random.Random(seed)
    key = str(rng.randrange(10000, 100000))
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    intro, needle, question = encode(INTRO), encode(NEEDLE.format(key=key)), encode(QUESTION)
    room = length - len(intro) - len(needle) - len(question)
    if room < 0:
        raise ValueError(f"a needle prompt needs at least {length - room} tokens, not {length}")
    pool = [encode(s) for s in sentences(essays())]
    order: List[int] = []
    filler: List[List[int]] = []
    used = 0
    while used < room:
        if not order:
            order = list(range(len(pool)))
            rng.shuffle(order)
        piece = pool[order.pop()][: room - used]
        filler.append(piece)
        used += len(piece)
    # Sentence boundaries in the filler, in tokens; the needle goes to the nearest.
    bounds, at = [0], 0
    for piece in filler:
        at += len(piece)
        bounds.append(at)
    target = depth * room
    cut = min(range(len(bounds)), key=lambda i: abs(bounds[i] - target))
    head = [t for piece in filler[:cut] for t in piece]
    tail = [t for piece in filler[cut:] for t in piece]
    ids = intro + head + needle + tail
    return NeedlePrompt(
        ids=ids, question=question, answer=key, depth=depth, needle_at=len(intro) + len(head)
    )
