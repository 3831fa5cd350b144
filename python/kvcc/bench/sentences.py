"""Deterministic generated sentences: topics with several phrasings each, so
nearest neighbours are meaningful for retrieval checks."""

from __future__ import annotations

import random

TOPICS = [
    ("the weather", ["rain is expected", "the sky turned grey", "a storm is coming", "it was sunny all day"]),
    ("cooking", ["the soup needs more salt", "bake the bread for an hour", "chop the onions finely", "the pasta is overcooked"]),
    ("football", ["the striker scored twice", "the referee showed a red card", "the match ended in a draw", "the goalkeeper saved a penalty"]),
    ("programming", ["the compiler rejected the code", "a memory leak crashed the server", "the tests pass again", "refactoring took all week"]),
    ("music", ["the orchestra tuned their instruments", "she played the piano beautifully", "the concert was sold out", "the drummer lost the beat"]),
    ("travel", ["the flight was delayed", "we missed the last train", "the hotel overlooked the sea", "our luggage was lost"]),
    ("medicine", ["the doctor prescribed antibiotics", "the patient recovered quickly", "the vaccine trial succeeded", "the nurse checked his pulse"]),
    ("finance", ["the stock market fell sharply", "interest rates were raised", "the bank approved the loan", "inflation slowed this quarter"]),
    ("gardening", ["the roses bloomed early", "weeds covered the vegetable bed", "water the tomatoes daily", "the apple tree needs pruning"]),
    ("astronomy", ["a comet passed close to earth", "the telescope found a new planet", "the moon eclipsed the sun", "the galaxy is expanding"]),
    ("cats", ["the cat slept on the sofa", "the kitten chased a mouse", "my cat ignores everyone", "the cat knocked over a glass"]),
    ("cars", ["the engine would not start", "the car needs new tyres", "electric cars charge overnight", "he crashed into a lamp post"]),
    ("school", ["the exam was surprisingly hard", "the teacher assigned homework", "the students went on a trip", "the library closes at six"]),
    ("history", ["the empire collapsed after the war", "the treaty ended the conflict", "the castle was built in 1200", "the king was overthrown"]),
    ("the ocean", ["whales migrate along the coast", "the tide came in quickly", "coral reefs are bleaching", "the waves crashed on the rocks"]),
    ("chemistry", ["the solution turned blue", "the reaction released heat", "the acid dissolved the metal", "the sample was contaminated"]),
    ("elections", ["the candidate conceded defeat", "turnout was unusually high", "the votes were recounted", "the debate turned heated"]),
    ("coffee", ["the espresso was too bitter", "she grinds the beans every morning", "the cafe ran out of milk", "decaf tastes the same to me"]),
    ("mountains", ["the climbers reached the summit", "snow blocked the pass", "the trail was steep and rocky", "an avalanche closed the road"]),
    ("films", ["the sequel was disappointing", "the actor won an award", "the cinema was half empty", "the plot twist surprised everyone"]),
]

OPENERS = ["", "apparently ", "yesterday ", "as usual ", "to be honest ", "in the end ", "once again ", "surprisingly "]
CLOSERS = ["", " according to the news", " which nobody expected", " and everyone noticed", " for the third time", " last weekend", " in the morning"]


def generate(count: int, seed: int = 0) -> list:
    """`count` sentences: topic phrases with random openers and endings, some
    joined with a second phrase of the same topic (lengths vary)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        topic, phrases = TOPICS[i % len(TOPICS)]
        first = rng.choice(phrases)
        sentence = f"{rng.choice(OPENERS)}{first}{rng.choice(CLOSERS)}"
        if rng.random() < 0.4:
            second = rng.choice([p for p in phrases if p != first])
            sentence += f", and {second}"
        if rng.random() < 0.3:
            sentence = f"talking about {topic}: {sentence}"
        out.append(sentence[0].upper() + sentence[1:] + ".")
    return out
