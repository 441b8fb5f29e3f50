"""fsdp_legacy/cli/lora.py, the LoRA recipe tools/bench_scale.py --lora measures: against the model it adapts (the
adapters start at zero, so the output is the frozen model's) and against the count of a rank-r adapter's parameters."""

import pytest
import torch
from torch import nn

from fsdp_legacy.cli.llama import PRESETS, Llama, next_token_loss
from fsdp_legacy.cli.lora import LoRALinear, to_lora


def test_adapters_only_train_and_start_as_the_frozen_model() -> None:
    torch.manual_seed(0)
    cfg = PRESETS["llama-tiny"].with_layers(2)
    model = Llama(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    before = model(ids).detach()
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear and "lm_head" not in name}
    to_lora(model, rank=4)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert set(trainable) == {f"{name}.lora_{ab}" for name in linears for ab in "ab"}
    assert sum(p.numel() for p in trainable.values()) == sum(
        4 * (m.in_features + m.out_features) for m in linears.values()
    )
    torch.testing.assert_close(model(ids), before, rtol=0, atol=0)  # B = 0: the adapters add nothing yet
    next_token_loss(model(ids), ids).backward()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert all(p.grad is not None for p in trainable.values())


def test_a_biased_layer_keeps_its_bias_and_a_bad_rank_is_refused() -> None:
    base = nn.Linear(6, 5)
    layer = LoRALinear(base.weight, 2, base.bias)
    x = torch.randn(3, 6)
    torch.testing.assert_close(layer(x), base(x))
    with pytest.raises(ValueError, match="LoRA rank 0: expected a rank of 1 or more"):
        to_lora(nn.Sequential(base), 0)
