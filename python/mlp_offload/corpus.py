"""A small generated text corpus and a character tokenizer for `train`.

The corpus is generated, not shipped: a seeded random walk over a little
grammar (short sentences about things and places, and sums written out in
words), so it is deterministic, needs no download, and has structure a
small model learns in a hundred steps (the loss falls well below the
unigram entropy).
"""

import random

import torch

_ADJ = ("small", "big", "red", "old", "quiet", "bright", "green", "cold", "warm", "dark")
_NOUN = ("cat", "dog", "bird", "house", "river", "tree", "stone", "ship", "town", "hill")
_VERB = ("sees", "likes", "finds", "follows", "watches", "passes", "leaves", "keeps")
_PREP = ("near", "under", "behind", "over", "beside")
_NAMES = ("ada", "bob", "eve", "max", "ivy", "leo", "mia", "tom")
_NUM = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
        "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
        "seventeen", "eighteen")


def _phrase(rng):
    det = rng.choice(("the", "a"))
    if rng.random() < 0.6:
        return f"{det} {rng.choice(_ADJ)} {rng.choice(_NOUN)}"
    return f"{det} {rng.choice(_NOUN)}"


def _sentence(rng):
    kind = rng.random()
    if kind < 0.45:
        s = f"{_phrase(rng)} {rng.choice(_VERB)} {_phrase(rng)}"
        if rng.random() < 0.5:
            s += f" {rng.choice(_PREP)} {_phrase(rng)}"
        return s + "."
    if kind < 0.7:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"{_NUM[a]} plus {_NUM[b]} is {_NUM[a + b]}."
    if kind < 0.9:
        name = rng.choice(_NAMES)
        return f"{name} {rng.choice(_VERB)} {_phrase(rng)}."
    return f"where is {_phrase(rng)}? it is {rng.choice(_PREP)} {_phrase(rng)}."


def generate(num_chars=200_000, seed=0):
    """About `num_chars` characters of text (deterministic for a seed)."""
    rng = random.Random(seed)
    parts, n = [], 0
    while n < num_chars:
        s = _sentence(rng)
        parts.append(s)
        n += len(s) + 1
    return "\n".join(parts) + "\n"


class CharTokenizer:
    """Characters to ids over the characters the text uses."""

    def __init__(self, text):
        self.chars = sorted(set(text))
        self._index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self):
        return len(self.chars)

    def encode(self, text):
        return torch.tensor([self._index[c] for c in text], dtype=torch.long)

    def decode(self, ids):
        return "".join(self.chars[int(i)] for i in ids)


class Batches:
    """Random (input, target) windows of `seq_len` tokens, reproducible: the
    i-th batch depends only on the seed and i."""

    def __init__(self, tokens, batch_size, seq_len, seed=0):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"the corpus ({len(tokens)} tokens) is shorter than "
                             f"seq_len + 1 ({seq_len + 1})")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed

    def batch(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,),
                               generator=g)
        x = torch.stack([self.tokens[s:s + self.seq_len] for s in starts.tolist()])
        y = torch.stack([self.tokens[s + 1:s + 1 + self.seq_len] for s in starts.tolist()])
        return x, y
