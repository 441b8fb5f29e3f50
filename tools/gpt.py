"""Small models and a synthetic corpus for the demo (train.py) and the benchmark (bench.py).

Everything here is plain PyTorch: no distributed code. The models are built so that
``ModuleWrapPolicy({Block})`` / ``ModuleWrapPolicy({MLPBlock})`` gives one FSDP unit per block.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# The GPT lives in the package (fsdp_legacy/cli/gpt.py), so that `fsdp-legacy mem-report` has it once installed.
from fsdp_legacy.cli.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig  # noqa: F401

# --------------------------------------------------------------------------------------
# GPT: generation (the model itself is re-exported above)
# --------------------------------------------------------------------------------------


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.8,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample ``max_new_tokens`` tokens after ``idx`` of shape (b, t).

    Always runs exactly ``max_new_tokens`` forwards, so with a sharded model every rank
    issues the same collectives (each forward all-gathers the parameters).
    """
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -block_size:])
        probs = F.softmax(logits[:, -1, :].float() / temperature, dim=-1)
        nxt = torch.multinomial(probs, num_samples=1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


# --------------------------------------------------------------------------------------
# DeepMLP: many tiny FSDP units, so per-unit overhead dominates (benchmark only)
# --------------------------------------------------------------------------------------


class MLPBlock(nn.Module):
    """Residual two-layer MLP block: the unit that FSDP wraps in DeepMLP."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


class DeepMLP(nn.Module):
    def __init__(self, d: int = 128, n_blocks: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(n_blocks))
        self.head = nn.Linear(d, d)  # keeps a parameter in the root unit, as in real models
        for m in self.modules():
            if isinstance(m, nn.Linear):
                # Small init keeps the 64-deep residual stream from blowing up.
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# --------------------------------------------------------------------------------------
# Synthetic corpus + char tokenizer
# --------------------------------------------------------------------------------------

_ADJS = ["small", "big", "red", "quiet", "happy", "old"]
_NOUNS = ["cat", "dog", "bird", "fox", "mouse", "horse"]
_VERBS = ["sees", "likes", "chases", "follows", "helps"]
_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:  # tiny grammar: spelling, word order, agreement-free syntax
        a, b = rng.sample(_NOUNS, 2)
        return f"the {rng.choice(_ADJS)} {a} {rng.choice(_VERBS)} the {b}."
    if kind == 1:  # counting: the successor of each digit is fully predictable
        start = rng.randrange(6)
        return "count " + " ".join(str(i) for i in range(start, start + 5)) + "."
    # small addition table with the answer spelled out: 25 facts to memorise
    x, y = rng.randrange(5), rng.randrange(5)
    return f"{x} plus {y} is {_NUMBERS[x + y]}."


def make_corpus(n_sentences: int = 20_000, seed: int = 0) -> str:
    """Deterministic text (same on every rank and every run) that a tiny model can learn."""
    rng = random.Random(seed)
    return "\n".join(_sentence(rng) for _ in range(n_sentences)) + "\n"


class CharTokenizer:
    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list[int]:
        return [self.stoi[c] for c in s]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def batches(
    data: torch.Tensor, batch_size: int, seq_len: int, rank: int, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random (x, y) windows from ``data``; y is x shifted by one.

    Each rank draws from its own generator, so ranks see different data (data parallelism)
    while the whole run stays reproducible for a given seed.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(len(data) - seq_len - 1, (batch_size, 1), generator=g)
        chunk = data[starts + offsets]  # (batch_size, seq_len + 1)
        yield chunk[:, :-1], chunk[:, 1:]
