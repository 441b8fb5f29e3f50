"""`fsdp-legacy migrate` on a class constructed with the wrapped model (Self-Forcing's `EMA_FSDP`, docs/migration.md's
fourth sample): its methods are handed the model later, by calls the tool does not follow (`ema.update(model)` on an
instance), and read `fsdp_module.module`, FSDP1's wrapped module, which an FSDP2 model lacks (AttributeError once an
EMA was configured). In a class some construction hands a wrapped model, such a read on a method's parameter or on
`self`'s attribute is guarded to take the model itself where it is FSDP2's, the attribute otherwise: right for every
value. Checked at 2 ranks against torch's FSDP1: the same EMA and weights."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from fsdp_legacy.migrate.program import migrate_program

_EMA = textwrap.dedent(
    """
    import functools

    import torch
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy


    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.proj(x))


    def fsdp_state_dict(model):
        config = FullStateDictConfig(rank0_only=True)  # (offload_to_cpu=True fails on a CPU device: FSDP1 on CPU)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            return model.state_dict()


    class EMA:
        def __init__(self, fsdp_module, decay=0.9):
            self.decay = decay
            self.shadow = {n: p.detach().clone().float() for n, p in fsdp_module.module.named_parameters()}

        @torch.no_grad()
        def update(self, fsdp_module):
            for n, p in fsdp_module.module.named_parameters():
                self.shadow[n].mul_(self.decay).add_(p.detach().float(), alpha=1.0 - self.decay)

        @torch.no_grad()
        def full_state_dict(self, fsdp_module):
            live = {n: p.detach().clone() for n, p in fsdp_module.module.named_parameters()}
            for n, p in fsdp_module.module.named_parameters():
                p.data.copy_(self.shadow[n])
            checkpoint = fsdp_state_dict(fsdp_module)
            for n, p in fsdp_module.module.named_parameters():
                p.data.copy_(live[n])
            return checkpoint


    class Keeper:
        def __init__(self, model):
            self.model = model

        def names(self):
            return [n for n, _ in self.model.module.named_parameters()]


    def run():
        torch.manual_seed(0)
        net = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(8, 2))
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        model = FSDP(net, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))
        ema = EMA(model)
        keeper = Keeper(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        torch.manual_seed(1 + torch.distributed.get_rank())
        for _ in range(4):
            model(torch.randn(4, 8)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            ema.update(model)
        return ema.full_state_dict(model), fsdp_state_dict(model), keeper.names()
    """
)


def run_both(original: str, migrated: str) -> dict[str, Any]:
    """On a rank: each program's `run()`, the FSDP1 original's and the migrated one's."""
    seen = {}
    for kind, source in (("fsdp1", original), ("fsdp2", migrated)):
        namespace: dict[str, Any] = {}
        exec(compile(source, f"{kind}.py", "exec"), namespace)
        seen[kind] = namespace["run"]()
    return seen


def test_a_class_handed_the_wrapped_model_reads_the_model_itself_under_fsdp2(ranks: Any) -> None:
    result = migrate_program({"train.py": _EMA}).results["train.py"]
    migrated = result.migrated
    assert "FullyShardedDataParallel" not in migrated and not result.findings
    guarded = "(fsdp_module if isinstance(fsdp_module, FSDPModule) else fsdp_module.module)"
    assert migrated.count(guarded) == 5  # every read in EMA's methods
    assert "(self.model if isinstance(self.model, FSDPModule) else self.model.module)" in migrated
    assert migrate_program({"train.py": migrated}).results["train.py"].migrated == migrated  # a second run
    for rank, seen in enumerate(ranks(run_both, 2, _EMA, migrated)):
        (ema1, weights1, names1), (ema2, weights2, names2) = seen["fsdp1"], seen["fsdp2"]
        assert names2 == ["0.proj.weight", "0.proj.bias", "1.proj.weight", "1.proj.bias", "2.weight", "2.bias"]
        assert len(names1) == len(names2)  # FSDP1's inner names hold `_fsdp_wrapped_module.`
        if rank:
            assert ema1 == {} and weights1 == {}  # rank0_only
            continue
        assert ema1.keys() == ema2.keys() == weights1.keys() == weights2.keys()
        for key in ema1:
            torch.testing.assert_close(ema2[key], ema1[key], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(weights2[key], weights1[key], rtol=1e-5, atol=1e-6)
            assert not torch.equal(ema1[key], weights1[key])  # the EMA is not the weights


_HELPERS = textwrap.dedent(
    """
    class EMA_FSDP:
        def __init__(self, fsdp_module, decay=0.999):
            self.decay = decay
            self.names = [n for n, _ in fsdp_module.module.named_parameters()]

        def copy_to(self, fsdp_module):
            return fsdp_module.module


    class Plain:
        def __init__(self, wrapper):
            self.inner = wrapper.module
    """
)

_TRAIN = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from utils.distributed import EMA_FSDP, Plain


    def main(net, ddp):
        model = FSDP(net)
        ema = EMA_FSDP(model, decay=0.99)
        other = Plain(ddp)
        return ema, other
    """
)


def test_a_class_of_another_file_handed_the_model_is_followed_and_no_other() -> None:
    program = migrate_program({"utils/distributed.py": _HELPERS, "train.py": _TRAIN})
    helpers = program.results["utils/distributed.py"].migrated
    assert helpers.count("(fsdp_module if isinstance(fsdp_module, FSDPModule) else fsdp_module.module)") == 2
    assert "self.inner = wrapper.module" in helpers  # Plain is handed no wrapped model
    assert "from torch.distributed.fsdp import FSDPModule" in helpers
    assert "fully_shard" in program.results["train.py"].migrated


_SOMETIMES = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


    def names(fsdp_module):
        return [n for n, _ in fsdp_module.module.named_parameters()]


    READERS = {"names": names}  # (a use that is no call: what it is handed elsewhere is unknown)


    def build(net):
        model = FSDP(net, use_orig_params=True)
        return model, names(model)
    """
)


def test_a_parameter_only_some_uses_hand_the_model_is_guarded_too() -> None:
    result = migrate_program({"train.py": _SOMETIMES}).results["train.py"]
    guarded = "(fsdp_module if isinstance(fsdp_module, FSDPModule) else fsdp_module.module)"
    assert guarded in result.migrated and not result.findings
