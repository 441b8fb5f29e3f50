"""Llama-style decoders with the published shapes of real models, for `tools/bench_scale.py` and
`fsdp-legacy mem-report --model llama-*`. Plain PyTorch: RMSNorm, rotary position embedding, grouped-query attention
(SDPA), a SwiGLU MLP; ``ModuleWrapPolicy({DecoderLayer})`` gives one unit per decoder layer.

The shapes are the models' own (their config.json): what decides memory and compute. Initial values are not theirs
(`init_weights` draws them from a seeded generator), nor are details that cost nothing (rope scaling).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_embeddings: bool = False
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def with_layers(self, num_layers: int | None) -> LlamaConfig:
        """The first `num_layers` decoder layers of this model (None: all)."""
        if num_layers is None:
            return self
        if not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"--layers {num_layers}: this model has 1 to {self.num_layers} decoder layers")
        return replace(self, num_layers=num_layers)

    def num_parameters(self) -> int:
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_kv_heads * self.head_dim
        per_layer = h * (h + 2 * kv + h) + 3 * h * i + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h


# Llama 3.2 1B and 3B, Llama 3.1 8B, Llama 2 13B and 70B (the 70B that FSDP + QLoRA made trainable on two 24 GB GPUs).
PRESETS: dict[str, LlamaConfig] = {
    "llama-1b": LlamaConfig(2048, 8192, 16, 32, 8, 128256, tie_embeddings=True),
    "llama-3b": LlamaConfig(3072, 8192, 28, 24, 8, 128256, tie_embeddings=True),
    "llama-8b": LlamaConfig(4096, 14336, 32, 32, 8, 128256),
    "llama-13b": LlamaConfig(5120, 13824, 40, 40, 40, 32000, rope_theta=10000.0),
    "llama-70b": LlamaConfig(8192, 28672, 80, 64, 8, 32000, rope_theta=10000.0),
    # not a real model: the test suite's size
    "llama-tiny": LlamaConfig(64, 192, 8, 4, 2, 512, tie_embeddings=True),
}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of (batch, heads, seq, head_dim), computed on the fly (no buffers to shard)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kv = cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(b, s, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = rotate(q, cfg.rope_theta), rotate(k, cfg.rope_theta)
        if cfg.num_kv_heads != cfg.num_heads:  # grouped-query attention: each kv head serves a group of q heads
            group = cfg.num_heads // cfg.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, cfg.hidden_size))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab); `loss(ids)` is next-token cross entropy."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


@torch.no_grad()
def init_weights(module: nn.Module, module_name: str, std: float = 0.02) -> None:
    """Fill `module`'s own parameters (not its children's) with values that depend on their names only: N(0, std)
    from a generator seeded by the parameter's name, `module_name` + "." + its attribute (a norm's weight: ones).
    The same model gets the same values whichever implementation materialises it, in whatever order; an FSDP2
    parameter (a DTensor) gets its shard of the values."""
    for attr, param in module.named_parameters(recurse=False):
        if isinstance(module, RMSNorm):
            param.fill_(1.0)
            continue
        local = param.to_local() if hasattr(param, "to_local") else param
        seed = zlib.crc32(f"{module_name}.{attr}".encode())
        local.normal_(0.0, std, generator=torch.Generator(device=local.device).manual_seed(seed))
