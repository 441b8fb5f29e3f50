"""Small models and a synthetic corpus for the demo (train.py) and the benchmark (bench.py).

Everything here is plain PyTorch: no distributed code. The models are built so that
``ModuleWrapPolicy({Block})`` / ``ModuleWrapPolicy({MLPBlock})`` gives one FSDP unit per block.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------
# GPT
# --------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128  # maximum sequence length (size of the position table)
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0, "d_model must be divisible by n_head"
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (b, t, 3d) -> 3 x (b, n_head, t, head_dim)
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: the unit that FSDP wraps."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # Tie after init so the shared tensor gets the embedding init (GPT-2 style). Both
        # modules stay in the root FSDP unit, so the shared parameter lives in one unit.
        self.lm_head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            # In float32 even when the model computes in bf16/fp16 (mixed precision).
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss


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
