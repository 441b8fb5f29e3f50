"""`fsdp-legacy migrate` on what a fifth sample of public FSDP1 programs showed (docs/migration.md):

- TransformerEngine's FSDP example hands the wrapped model to `prepare_te_modules_for_fsdp(model)`, which asserts
  `isinstance(model, FullyShardedDataParallel)`: the file was migrated, with no report, into an AssertionError. A
  wrapped model handed to an FSDP helper outside the files migrated is now reported, and the file left as it is.
- dpo-v2 builds `mixed_precision = MixedPrecision(...)` and returns `FSDP(..., mixed_precision=mixed_precision)`: the
  keyword counted as a second use of the name, so the policy stayed FSDP1's while the construction became fully_shard
  with it as `mp_policy` (a mix, an AttributeError at the first forward). The keyword is no use now; and a policy that
  stays FSDP1's because some other use may reach an FSDP1 construction is read at run time by fsdp1_options.
- OpenFIM's trainer builds its policy in a method, `self._get_wrap_policy(model)`: the FSDP1 policy in it was
  reported though apply_fully_shard evaluates it as FSDP1 does, as it does for a function's."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import torch

pytest.importorskip("libcst")

from test_migrate_receiving_class import run_both

from fsdp_legacy.migrate.program import migrate_program
from fsdp_legacy.migrate.rewriter import migrate_source

_TE = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from transformer_engine.pytorch.distributed import prepare_te_modules_for_fsdp
    from slam_llm.utils import fsdp_auto_wrap_policy


    def main(net):
        policy = fsdp_auto_wrap_policy(net, torch.nn.Linear)
        net = FullyShardedDataParallel(net, auto_wrap_policy=policy, use_orig_params=True)
        prepare_te_modules_for_fsdp(net)
        return net
    """
)


def test_a_wrapped_model_handed_to_another_librarys_fsdp_helper_keeps_the_file() -> None:
    result = migrate_source(_TE)
    assert result.migrated == _TE
    whats = [f.what for f in result.findings]
    assert whats == ["`prepare_te_modules_for_fsdp(...)`", "wrapped model handed to an FSDP helper outside the program"]
    assert "transformer_engine.pytorch.distributed.prepare_te_modules_for_fsdp" in result.findings[0].why
    assert [f.what for f in migrate_source(result.migrated).findings] == whats  # a second run reports the same


def test_the_plain_module_handed_to_one_ahead_of_its_wrapping_migrates() -> None:
    """SLAM-LLM's `fsdp_auto_wrap_policy(model, ...)` before `model = FSDP(model, ...)`: the plain module."""
    source = _TE.replace("    prepare_te_modules_for_fsdp(net)\n", "")
    result = migrate_source(source)
    assert "apply_fully_shard(net, policy" in result.migrated and not result.findings


_HELPERS = textwrap.dedent(
    """
    def prepare_for_fsdp(model):
        return model.clip_grad_norm_(1.0)
    """
)

_TRAIN = textwrap.dedent(
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from utils.fsdp_utils import prepare_for_fsdp


    def main(net):
        model = FSDP(net)
        prepare_for_fsdp(model)
    """
)


def test_an_fsdp_helper_of_the_programs_own_files_is_followed() -> None:
    program = migrate_program({"utils/fsdp_utils.py": _HELPERS, "train.py": _TRAIN})
    assert "fully_shard(net)" in program.results["train.py"].migrated
    assert "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)" in program.results["utils/fsdp_utils.py"].migrated
    assert not any(f for r in program.results.values() for f in r.findings)


_RETURNED = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision


    def build_fsdp(model):
        mixed_precision = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
        return FSDP(model, mixed_precision=mixed_precision)
    """
)


def test_a_policy_named_by_its_keyword_is_rewritten_with_its_construction() -> None:
    result = migrate_source(_RETURNED)
    assert "mixed_precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16)" in result.migrated
    assert '{"mp_policy": mixed_precision}' in result.migrated and not result.findings


_TRAINER = textwrap.dedent(
    """
    import functools

    import torch
    from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    POLICIES = []


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))
            self.head = torch.nn.Linear(16, 1)
            self.register_buffer("shift", torch.full((16,), 0.1))

        def forward(self, x):
            return self.head(torch.tanh(self.layers(x + self.shift)))


    class Trainer:
        def __init__(self, net):
            self.net = net

        def _get_wrap_policy(self):
            return functools.partial(size_based_auto_wrap_policy, min_num_params=200)

        def fsdp_initialize(self):
            wrap_policy = self._get_wrap_policy()
            mp = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
            POLICIES.append(mp)
            self.net = FSDP(self.net, auto_wrap_policy=wrap_policy, mixed_precision=mp, device_id=torch.device("cpu"))

        def train(self):
            optimizer = torch.optim.SGD(self.net.parameters(), lr=0.1)
            torch.manual_seed(1 + torch.distributed.get_rank())
            losses = []
            for _ in range(3):
                loss = self.net(torch.randn(8, 16)).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            with FSDP.state_dict_type(self.net, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
                return losses, self.net.state_dict()


    def run():
        torch.manual_seed(0)
        trainer = Trainer(Net())
        trainer.fsdp_initialize()
        return trainer.train()
    """
)


def test_a_policy_used_again_and_a_methods_policy_migrate_and_train_as_fsdp1(ranks: Any) -> None:
    result = migrate_source(_TRAINER)
    migrated = result.migrated
    assert not result.findings
    assert "fsdp1_options(mixed_precision=mp)" in migrated  # FSDP1's policy, read at run time
    assert "apply_fully_shard(self.net, wrap_policy" in migrated and "FullyShardedDataParallel" not in migrated
    for rank, seen in enumerate(ranks(run_both, 2, _TRAINER, migrated)):
        (losses1, state1), (losses2, state2) = seen["fsdp1"], seen["fsdp2"]
        torch.testing.assert_close(losses2, losses1, rtol=1e-5, atol=1e-6)
        if rank:
            assert state1 == {} and state2 == {}
            continue
        assert state1.keys() == state2.keys()
        for key in state1:  # (the bf16 buffer compared as values)
            torch.testing.assert_close(state2[key].float(), state1[key].float(), rtol=1e-5, atol=1e-6)
