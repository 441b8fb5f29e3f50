"""Small test models covering the shapes of real FSDP1 code: the FACTS `Net`, a transformer with tied embeddings
and buffers, a mixture-of-experts-like layer, a model with frozen parameters, and a manually wrapped nested model."""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 5)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(5, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    """The model of ../shared/FSDP1_FACTS.md: two units with ModuleWrapPolicy({Block})."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 5)
        self.block = Block()
        self.l2 = nn.Linear(3, 2)
        self.register_buffer("buf", torch.arange(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.block(self.l1(x))) + self.buf

    @staticmethod
    def batch(seed: int) -> torch.Tensor:
        return torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))


class TransformerBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """Token + position embeddings, blocks, final norm, LM head tied to the token embedding, a buffer."""

    vocab, seq = 23, 8

    def __init__(self, d: int = 16, heads: int = 2, layers: int = 3) -> None:
        super().__init__()
        self.tok = nn.Embedding(self.vocab, d)
        self.pos = nn.Parameter(torch.randn(self.seq, d) * 0.02)
        self.blocks = nn.ModuleList(TransformerBlock(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, self.vocab, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("scale", torch.tensor([1.0, 0.5]))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)) * self.scale[0]
        return F.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten())

    @classmethod
    def batch(cls, seed: int) -> torch.Tensor:
        return torch.randint(cls.vocab, (2, cls.seq), generator=torch.Generator().manual_seed(seed))


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


class MoE(nn.Module):
    """Top-1 routing over experts: each step some experts get no tokens on a rank (unused parameters)."""

    def __init__(self, d: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(Expert(d) for _ in range(experts))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        gates = self.router(h).softmax(-1)
        choice = gates.argmax(-1)
        y = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            picked = choice == i
            if picked.any():
                y[picked] = expert(h[picked]) * gates[picked, i : i + 1]
        return self.out(y + h).sum()

    @staticmethod
    def batch(seed: int) -> torch.Tensor:
        return torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))


class Frozen(nn.Module):
    """A frozen embedding-like stem (its own unit), a trainable body, and a partly frozen head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(4, 6), nn.Tanh())
        self.body = nn.Sequential(Block(), nn.Linear(3, 5))
        self.head = nn.Linear(5, 2)
        for p in self.stem.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)[:, :5])).pow(2).sum()

    @staticmethod
    def batch(seed: int) -> torch.Tensor:
        return torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))


class Nested(nn.Module):
    """Built under enable_wrap(): inner layers wrapped by hand with wrap(), two levels deep."""

    def __init__(self, wrap=lambda m: m) -> None:
        super().__init__()
        self.a = wrap(nn.Linear(4, 6))
        self.mid = wrap(nn.Sequential(wrap(nn.Linear(6, 6)), nn.ReLU(), nn.Linear(6, 4)))
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.mid(self.a(x))).pow(2).sum()

    @staticmethod
    def batch(seed: int) -> torch.Tensor:
        return torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))
