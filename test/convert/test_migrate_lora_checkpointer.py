"""`fsdp-legacy migrate` on a LoRA fine-tune in mistral-finetune's style: a model built on the meta device, loaded
on rank 0 only (`load_state_dict(..., assign=True)`) and materialized elsewhere by a `param_init_fn`, wrapped with
`sync_module_states=True` under `_or_policy` (a unit per fully trainable module, one per block), and a checkpointer
holding the model as `self.model` that saves either the LoRA weights alone, unit by unit (`named_modules()` filtered
by `is_fsdp = isinstance(module, FullyShardedDataParallel)` and `module.module.children()`, then
`module.summon_full_params(module, ...)` after `assert isinstance(module, FullyShardedDataParallel)`), or the merged
model (`self.model.summon_full_params(self.model, ...)`, a state-dict hook merging each LoRA layer). Before, both
summons, called through the instance, were reported as on objects not known to be wrapped and the file stayed FSDP1
beside a model that had become FSDP2's. The oracle is FSDP1 (fsdp_legacy's: torch's refuses sync_module_states on
the CPU) running the original beside the migrated program at 2 ranks: the same losses and both checkpoints equal,
then a second run of each built from the FSDP1 run's merged checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from fsdp_legacy.migrate.rewriter import migrate_source

_PROGRAM = """
import functools
import math
from typing import Dict, Union

import torch
import torch.distributed as dist
import torch.distributed.fsdp.wrap as torch_wrap
from torch.distributed.fsdp import BackwardPrefetch
from torch.distributed.fsdp.api import ShardingStrategy
from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel


class LoRALinear(torch.nn.Module):
    def __init__(self, d_in, d_out, rank=2, scaling=0.5):
        super().__init__()
        self.frozen_W = torch.nn.Linear(d_in, d_out, bias=False)
        self.lora_A = torch.nn.Linear(d_in, rank, bias=False)
        self.lora_B = torch.nn.Linear(rank, d_out, bias=False)
        self.scaling = scaling

    def merge_weight(self):
        with torch.no_grad():
            return self.frozen_W.weight + (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def forward(self, x):
        return self.frozen_W(x) + self.lora_B(self.lora_A(x)) * self.scaling


class TransformerBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = LoRALinear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return x + torch.tanh(self.attention(self.norm(x)))


class Transformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([TransformerBlock(), TransformerBlock()])
        self.output = torch.nn.Linear(8, 2, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def get_fsdp_policy(is_lora):
    transformer_block_wrap_policy = functools.partial(
        torch_wrap.transformer_auto_wrap_policy, transformer_layer_cls=(TransformerBlock,)
    )
    if not is_lora:
        return transformer_block_wrap_policy

    def fsdp_lora_policy_fn(module):
        return all(p.requires_grad for p in module.parameters())

    fsdp_lora_policy = functools.partial(torch_wrap.lambda_auto_wrap_policy, lambda_fn=fsdp_lora_policy_fn)
    return functools.partial(torch_wrap._or_policy, policies=[fsdp_lora_policy, transformer_block_wrap_policy])


def initialize_lora_parameters(model):
    generator = torch.Generator().manual_seed(7)
    for m_name, module in model.named_modules():
        if all(p.is_meta for p in module.parameters()):
            for p_name, param in module.named_parameters():
                module._parameters[p_name] = torch.nn.Parameter(torch.empty_like(param, device="cpu"))
                param = module._parameters[p_name]
                with torch.no_grad():
                    if m_name.split(".")[-1] == "lora_A":
                        bound = 1 / math.sqrt(param.shape[1])
                        param.uniform_(-bound, bound, generator=generator)
                    else:
                        param.zero_()


def load_model(state_dict) -> FullyShardedDataParallel:
    with torch.device("meta"):
        model = Transformer()
    if dist.get_rank() == 0:
        model.load_state_dict(state_dict, assign=True, strict=False)
        initialize_lora_parameters(model)
        param_init_fn = None
    else:

        def param_init_fn(m):
            m.to_empty(device=torch.device("cpu"), recurse=False)

    dist.barrier()
    for name, param in model.named_parameters():
        param.requires_grad = "lora" in name
    wrapped_model = FullyShardedDataParallel(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=get_fsdp_policy(True),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        limit_all_gathers=True,
        device_id=torch.device("cpu"),
        sync_module_states=True,
        param_init_fn=param_init_fn,
    )
    return wrapped_model


class Checkpointer:
    def __init__(self, model: FullyShardedDataParallel):
        self.model = model

    @staticmethod
    def get_non_lora_states(state_dict):
        return {k: v for k, v in state_dict.items() if not any(key in k for key in ["lora", "frozen"])}

    @torch.no_grad()
    def retrieve_save_states(self, save_only_lora, save_dtype) -> Dict[str, torch.Tensor]:
        for module in self.model.modules():
            if isinstance(module, LoRALinear) and hasattr(module, "_merge_lora_handle"):
                module._merge_lora_handle.remove()
        if not save_only_lora:

            def merge_lora(m, destination, prefix, *args):
                destination[prefix + "weight"] = m.merge_weight()

            for module in self.model.modules():
                if isinstance(module, LoRALinear):
                    module._merge_lora_handle = module._register_state_dict_hook(merge_lora)

        offload_to_cpu = False  # (torch's FSDP1 cannot offload when the compute device is the CPU)
        if save_only_lora:

            def is_trainable_fsdp(module: Union[torch.nn.Module, FullyShardedDataParallel]):
                is_fsdp = isinstance(module, FullyShardedDataParallel)
                all_params_have_grads = is_fsdp and all(p.requires_grad is True for p in module.parameters())
                is_leaf_node = is_fsdp and len(list(module.module.children())) == 0
                return is_fsdp and all_params_have_grads and is_leaf_node

            modules = {k: m for k, m in self.model.named_modules() if is_trainable_fsdp(m)}
            states = {}
            for key, module in modules.items():
                assert isinstance(module, FullyShardedDataParallel), "`module` should be FSDP's"
                parent_prefix = key.replace("_fsdp_wrapped_module.", "")
                with module.summon_full_params(module, writeback=True, offload_to_cpu=offload_to_cpu):
                    states.update(
                        {f"{parent_prefix}.{k}": v.to(dtype=save_dtype) for k, v in module.state_dict().items()}
                    )
        else:
            assert isinstance(self.model, FullyShardedDataParallel), "`self.model` should be FSDP's"
            with self.model.summon_full_params(self.model, writeback=True, offload_to_cpu=offload_to_cpu):
                states = self.get_non_lora_states(self.model.state_dict())
                states = {k: v.to(dtype=save_dtype) for k, v in states.items()}
        return dict(sorted(states.items()))


def train(state_dict, steps=2):
    model = load_model(state_dict)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    losses = []
    for step in range(steps):
        data = torch.Generator().manual_seed(10 * step + dist.get_rank())
        loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8, generator=data)), torch.ones(4, 2))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    checkpointer = Checkpointer(model)
    lora = checkpointer.retrieve_save_states(save_only_lora=True, save_dtype=torch.float32)
    merged = checkpointer.retrieve_save_states(save_only_lora=False, save_dtype=torch.float32)
    return losses, lora, merged
"""


def test_the_checkpointer_migrates_whole() -> None:
    result = migrate_source(_PROGRAM)
    assert result.findings == [], [f.format("finetune.py") for f in result.findings]
    out = result.migrated
    assert ".summon_full_params(" not in out and ", FullyShardedDataParallel" not in out
    assert "with full_params(module, writeback=True, offload_to_cpu=offload_to_cpu):" in out
    assert "is_fsdp and len(list(module.children())) == 0" in out  # the unit is the module under FSDP2
    # inside the gathered block the module's own state_dict() is FSDP1's full dict, the merge hook's key included
    assert "states = self.get_non_lora_states(self.model.state_dict())" in out
    again = migrate_source(out)
    assert (again.migrated, again.findings) == (out, [])


def _base_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    shapes = {"output.weight": (2, 8)}
    for layer in range(2):
        shapes[f"layers.{layer}.attention.frozen_W.weight"] = (8, 8)
        shapes[f"layers.{layer}.norm.weight"] = (8,)
        shapes[f"layers.{layer}.norm.bias"] = (8,)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def _side_by_side(original: str, migrated: str, folder: str) -> dict[str, Any]:
    import torch.distributed as dist

    seen = {}
    for kind, source in (("fsdp1", original), ("fsdp2", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, f"{kind}.py", "exec"), namespace)
        first = namespace["train"](_base_weights() if dist.get_rank() == 0 else None)
        if kind == "fsdp1" and dist.get_rank() == 0:
            torch.save(first[2], os.path.join(folder, "consolidated.pt"))
        dist.barrier()
        merged = torch.load(os.path.join(folder, "consolidated.pt"), weights_only=True)  # the next base model
        merged = {k.replace("attention.weight", "attention.frozen_W.weight"): v for k, v in merged.items()}
        again = namespace["train"](merged if dist.get_rank() == 0 else None, steps=1)
        seen[kind] = first, again[0]
    return seen


def test_the_migrated_finetune_saves_lora_and_merged_weights_as_fsdp1(ranks: Any, tmp_path: Path) -> None:
    migrated = migrate_source(_PROGRAM).migrated
    # torch's FSDP1 refuses sync_module_states on the CPU: fsdp_legacy's FSDP1 (equal to it in the parity tests) runs
    # the original program
    original = _PROGRAM.replace("torch.distributed.fsdp", "fsdp_legacy")
    for seen in ranks(_side_by_side, 2, original, migrated, str(tmp_path)):
        (losses1, lora1, merged1), again1 = seen["fsdp1"]
        (losses2, lora2, merged2), again2 = seen["fsdp2"]
        assert losses2 == pytest.approx(losses1, rel=1e-5)
        assert sorted(lora1) == sorted(lora2) and len(lora1) == 4  # lora_A and lora_B of both blocks
        assert sorted(merged1) == sorted(merged2) and "layers.0.attention.frozen_W.weight" not in merged1
        for ours, theirs in ((lora2, lora1), (merged2, merged1)):
            assert all(torch.allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-7) for k in theirs)
        assert again2 == pytest.approx(again1, rel=1e-5)
