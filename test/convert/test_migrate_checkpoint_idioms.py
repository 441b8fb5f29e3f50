"""`fsdp-legacy migrate` on the checkpoint code of public FSDP1 programs (pytorch/examples' and llama-recipes'
checkpoint handlers, OLMo's and torchtune's trainers): configs built as names before the block, computed values
among them, and state_dict_type blocks around calls on a model that is a function parameter or an attribute. A
block is taken away only with every call whose result its type decides; otherwise it stays and is reported. The
oracle is torch's FSDP1 running the same functions: what each rank gets and loads."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

pytest.importorskip("libcst")

import ast

from test_migrate import _fsdp1_names
from test_migrate_state_dict_type import _equal, _under_the_set_type

from fsdp_legacy.migrate.rewriter import migrate_source

_HEADER = """
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

fullstate_save_policy = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
"""

# A checkpoint handler in the styles of the public ones: module-level and local configs, computed values, the model
# a parameter (save_full, save_sharded) or an attribute (Checkpointer).
_HANDLER = """

def save_model_checkpoint(model):
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, fullstate_save_policy):
        cpu_state = model.state_dict()
    return cpu_state


def save_full(model, optimizer, device, rank0):
    save_policy = FullStateDictConfig(
        offload_to_cpu=device.type != "cpu",  # a computed value, as pytorch/examples' T5 trainer writes it
        rank0_only=rank0 and dist.get_world_size() > 1,
    )
    optim_policy = FullOptimStateDictConfig(offload_to_cpu=device.type != "cpu", rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy, optim_policy):
        return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}


def save_sharded(model, optimizer, device):
    save_policy = ShardedStateDictConfig(offload_to_cpu=device.type == "cpu")
    optim_policy = ShardedOptimStateDictConfig(device.type == "cpu")
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, save_policy, optim_policy):
        return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}


class Checkpointer:
    def __init__(self, model):
        self._model = model

    def load(self, state):
        with FSDP.state_dict_type(self._model, StateDictType.FULL_STATE_DICT):
            self._model.load_state_dict(state)
        with FSDP.state_dict_type(self._model, StateDictType.FULL_STATE_DICT):
            return self._model.state_dict()


def run():
    torch.manual_seed(0)
    net = FSDP(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
               device_id=torch.device("cpu"))
    optim = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.randn(2, 4)).sum().backward()
    optim.step()
    device = torch.device("cpu")
    on_rank0, everywhere = save_full(net, optim, device, True), save_full(net, optim, device, False)
    loaded = Checkpointer(net).load({k: v * 2 for k, v in everywhere["model"].items()})
    return save_model_checkpoint(net), on_rank0, everywhere, save_sharded(net, optim, device), loaded
"""


def test_configs_named_before_the_block_are_followed() -> None:
    result = migrate_source(_HEADER + _HANDLER)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert _fsdp1_names(ast.parse(out)) == set() and "state_dict_type" not in out
    # a literal config used once: its options inline, its assignment gone
    full_rank0 = "StateDictOptions(full_state_dict=True, cpu_offload=True)"
    assert f"cpu_state = get_model_state_dict(model, options={full_rank0})" in out
    assert "fullstate_save_policy" not in out
    # computed values: the config is built where it was, by a helper that decides at run time, with its comments
    assert (
        "save_policy = full_state_dict_options(\n"
        '        offload_to_cpu=device.type != "cpu",  # a computed value, as pytorch/examples\' T5 trainer writes it\n'
        "        rank0_only=rank0 and dist.get_world_size() > 1,\n    )" in out
    )
    assert 'optim_policy = sharded_state_dict_options(device.type == "cpu")' in out
    assert '"model": get_model_state_dict(model, options=save_policy)' in out
    assert '"optim": get_optimizer_state_dict(model, optimizer, options=optim_policy)' in out
    # the model an attribute
    assert "set_model_state_dict(self._model, state, options=StateDictOptions(full_state_dict=True))" in out
    assert "return get_model_state_dict(self._model, options=StateDictOptions(full_state_dict=True))" in out


def test_the_migrated_handler_saves_and_loads_what_fsdp1_does(ranks: Any) -> None:
    """Per rank: the FULL dicts (rank 0's only, under the computed rank0_only), the SHARDED shards, and the model's
    state after a load through the attribute, equal to torch's FSDP1 running the original."""
    source = _HEADER + _HANDLER
    for rank, (fsdp1, fsdp2) in enumerate(ranks(_under_the_set_type, 2, source, migrate_source(source).migrated)):
        saved = fsdp1[1]
        # (the oracle's own shapes: rank 0's full dict only under rank0_only, every rank's otherwise, shards)
        assert (saved[0][1] == {}) == (rank == 1) and (saved[1][1]["model"][1] == {}) == (rank == 1)
        assert {kind for kind, _ in saved[3][1]["model"][1].values()} == {"shard"}
        assert _equal(fsdp2, fsdp1)


_KEPT = {
    "trainer.save_model()": ("trainer.model", "trainer.save_model(path)"),
    # (`inner.state_dict()` alone becomes state_dict_beside: test_migrate_ema_beside.py)
    "another object's call in a form not mapped": (
        "model",
        "saved = {'a': model.state_dict(), 'b': inner.state_dict(d)}",
    ),
    "a method on the object holding the model": ("self._model", "sd = self._model.state_dict()\nself.write(sd)"),
    "the model handed to a call": ("model", "sd = model.state_dict()\ncheckpoint.save({'model': model})"),
    "a form not mapped": ("model", "sd = model.state_dict(prefix='x.')"),
    "an FSDP1 call left in place": ("model", "osd = FSDP.optim_state_dict(model, optim, group=group)"),
    "a save this tool cannot see into": ("model", "sd = model.state_dict()\nsave_checkpoint(sd, path)"),
}


@pytest.mark.parametrize(("model", "body"), _KEPT.values(), ids=list(_KEPT))
def test_a_block_with_a_call_that_may_read_its_type_stays(model: str, body: str) -> None:
    """Taken away, the block would leave that call on FSDP2's default (each rank's DTensor shards, where FSDP1 gave
    a full state dict): it stays as written, with every call in it, reported at the block's line."""
    source = textwrap.dedent(
        f"""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

        def save(self, trainer, model, inner, optim, group, checkpoint, path):
            with FSDP.state_dict_type({model}, StateDictType.FULL_STATE_DICT):
        """
    ) + textwrap.indent(body, " " * 8)
    result = migrate_source(source + "\n")
    assert result.migrated == source + "\n"
    assert [f.line for f in result.findings if "it stays" in f.why] == [5], [f.format("x.py") for f in result.findings]


def test_a_config_shared_with_a_block_that_stays_keeps_both() -> None:
    """A computed config is rebuilt as StateDictOptions only when every block that uses it goes."""
    source = textwrap.dedent(
        """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, FullStateDictConfig

        def save(model, trainer, flag):
            policy = FullStateDictConfig(rank0_only=flag)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, policy):
                sd = model.state_dict()
            with FSDP.state_dict_type(trainer.model, StateDictType.FULL_STATE_DICT, policy):
                trainer.save_model()
            return sd
        """
    )
    result = migrate_source(source)
    assert result.migrated == source
    assert sorted(f.line for f in result.findings if "it stays" in f.why) == [6, 8]


@pytest.mark.parametrize(
    "config",
    [
        # (computed and written inline, `FullStateDictConfig(rank0_only=flag)`, it is decided at run time where the
        # block starts: test_migrate_run_time_types.py)
        "FullStateDictConfig(**kwargs)",
        "make_config()",
    ],
)
def test_configs_it_cannot_read_keep_the_block(config: str) -> None:
    source = textwrap.dedent(
        f"""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, FullStateDictConfig

        def save(model, flag, kwargs):
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, {config}):
                return model.state_dict()
        """
    )
    result = migrate_source(source)
    assert result.migrated == source and result.findings


# torch's FSDP1 DCP recipe (its distributed checkpoint tutorial): a SHARDED save, and the resume through
# load_sharded_optimizer_state_dict, whose ShardedTensors FSDP2's optimizer cannot step with.
_RESUME = """
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dist_cp
import torch.nn as nn
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def build():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    model = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    return model, optim, torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)


def train(model, optim, scheduler, steps, seed):
    losses = []
    for step in range(steps):
        data = torch.Generator().manual_seed(seed + 10 * step + dist.get_rank())
        loss = model(torch.randn(4, 8, generator=data)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def save(path):
    model, optim, scheduler = build()
    train(model, optim, scheduler, 2, 0)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dist_cp.save(state_dict, storage_writer=dist_cp.FileSystemWriter(path))
        torch.save(scheduler.state_dict(), f"{path}.scheduler{dist.get_rank()}")  # (another object's call: awsome's)
    return train(model, optim, scheduler, 3, 100)


def resume(path):
    model, optim, scheduler = build()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict()}
        dist_cp.load(state_dict, storage_reader=dist_cp.FileSystemReader(path))
        model.load_state_dict(state_dict["model"])
        scheduler.load_state_dict(torch.load(f"{path}.scheduler{dist.get_rank()}"))
        # the optimizer's state, laid out by the model's
        optim_state = load_sharded_optimizer_state_dict(
            model_state_dict=state_dict["model"],
            optimizer_key="optim",
            storage_reader=dist_cp.FileSystemReader(path),
        )
        LOAD
    return train(model, optim, scheduler, 3, 100)
"""

_LOADS = {
    "nested": 'optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, optim_state["optim"]))',
    "through a name": 'flattened_osd = FSDP.optim_state_dict_to_load(model, optim, optim_state["optim"])\n'
    "        optim.load_state_dict(flattened_osd)",
    # awsome-distributed-training's: converted in a nested block, loaded after it
    "in a nested block": "with warnings.catch_warnings():\n"
    '            warnings.simplefilter("ignore", UserWarning)\n'
    '            flattened_osd = FSDP.optim_state_dict_to_load(model, optim, optim_state["optim"])\n'
    "        optim.load_state_dict(flattened_osd)",
}


def _resumed(fsdp1_source: str, migrated_source: str, path: str) -> tuple[list[float], list[float], list[float]]:
    """On a rank: the FSDP1 program's losses after its save, and each program's after resuming from that save."""
    programs = []
    for source in (fsdp1_source, migrated_source):
        scope: dict[str, Any] = {}
        exec(compile(source, "program.py", "exec"), scope)
        programs.append(scope)
    after_save = programs[0]["save"](path)
    return after_save, programs[0]["resume"](path), programs[1]["resume"](path)


@pytest.mark.parametrize("load", list(_LOADS))
def test_the_sharded_resume_becomes_fsdp2s_recipe(ranks: Any, tmp_path: Any, load: str) -> None:
    source = _RESUME.replace("LOAD", _LOADS[load])
    result = migrate_source(source)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert "load_sharded_optimizer_state_dict" not in out and _fsdp1_names(ast.parse(out)) == set()
    assert (
        "    # the optimizer's state, laid out by the model's\n    optim_state = {\"optim\": "
        "get_optimizer_state_dict(model, optim, options=StateDictOptions(cpu_offload=True))}" in out
    )
    assert "torch.distributed.checkpoint.load(optim_state, storage_reader=dist_cp.FileSystemReader(path))" in out
    loads = "loaded_optim_state_dict" if load == "in a nested block" else "set_optimizer_state_dict"
    assert f'{loads}(model, optim, optim_state["optim"], options=' in out
    assert "state_dict_beside(scheduler, model, StateDictOptions())" in out
    for after_save, fsdp1, fsdp2 in ranks(_resumed, 2, source, out, str(tmp_path / "ckpt")):
        assert fsdp1 == pytest.approx(after_save, rel=1e-6)  # (the oracle: FSDP1 resumes as it went on)
        assert fsdp2 == pytest.approx(after_save, rel=1e-5)


@pytest.mark.parametrize(
    "load",
    [
        'osd = optim_state["optim"]\n        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd))',
        "print(optim_state)\n        optim.load_state_dict("
        'FSDP.optim_state_dict_to_load(model, optim, optim_state["optim"]))',
        'optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, optim_state["other"]))',
    ],
    ids=["another name", "the result used twice", "another key"],
)
def test_a_sharded_resume_in_another_form_is_kept_and_reported(load: str) -> None:
    """set_optimizer_state_dict fed with ShardedTensors fails at the first step after resuming: all or nothing."""
    source = _RESUME.replace("LOAD", load)
    result = migrate_source(source)
    assert "optim_state_dict_to_load(model, optim" in result.migrated
    assert "load_sharded_optimizer_state_dict(" in result.migrated
    assert any("ShardedTensors" in f.why or "state_dict_type" in f.what for f in result.findings)
