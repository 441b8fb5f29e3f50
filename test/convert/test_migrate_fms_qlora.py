"""`fsdp-legacy migrate` on the idioms measured in Answer.AI's fsdp_qlora (train.py) and IBM's fms-fsdp
(main_training*.py, fms_fsdp/utils, fms_fsdp/policies), written here in their style: no_sync() taken as a value and
entered later, a config shared by two blocks, safetensors' save_file under a FULL block, the LoRA units' state dicts
taken one by one, a checkpointer whose model is a parameter (its single-file load outside the blocks with strict=,
the optimizer's to-load call after its SHARDED block, `model._orig_mod` for a compiled model), FSDP1's attributes,
and policies modules whose values reach the constructions of other files at run time. The oracle is torch's FSDP1
running the original at 2 ranks."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("libcst")

import torch
from test_migrate import _fsdp1_names
from test_migrate_checkpoint_idioms import _resumed
from test_migrate_precision import _both_programs, _migrated
from test_migrate_state_dict_type import _equal

from fsdp_legacy.migrate.program import migrate_program
from fsdp_legacy.migrate.rewriter import migrate_source


def _wrapped_names(source: str) -> set[str]:
    """The names the file wraps (`name = FSDP(...)`): a method called on one is rewritten wherever it stands."""
    import libcst as cst

    from fsdp_legacy.migrate.survey import Survey

    survey = Survey()
    cst.MetadataWrapper(cst.parse_module(source)).visit(survey)
    return survey.models


# fsdp_qlora's training loop and its save, on a model with LoRA units of their own.
_QLORA = """
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Lora(nn.Module):
    def __init__(self):
        super().__init__()
        self.lora_AB = nn.Sequential(nn.Linear(8, 2, bias=False), nn.Linear(2, 8, bias=False))

    def forward(self, x):
        return self.lora_AB(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.lora = Lora()

    def forward(self, x):
        return self.base(x) + self.lora(x)


def run(lora_only=True, no_sync=True):
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(Block(), Block()), auto_wrap_policy=ModuleWrapPolicy({Block, Lora}),
                 device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch_idx in range(6):
        accumulate_grads = (batch_idx + 1) % 2 == 0
        if no_sync and not accumulate_grads:
            sync_context = model.no_sync()
        else:
            sync_context = nullcontext()
        data = torch.Generator().manual_seed(batch_idx + 10 * dist.get_rank())
        with sync_context:
            loss = model(torch.randn(4, 8, generator=data)).pow(2).mean()
            loss.backward()
        if accumulate_grads:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    save_policy = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)  # (FSDP1 offloads wrongly on CPU)
    cpu_state_dict = {}
    if lora_only:
        trainable_fsdp_modules = [(n, m) for n, m in model.named_modules() if n.endswith("lora_AB")]
        for prefix, module in trainable_fsdp_modules:
            prefix = prefix.replace("_fsdp_wrapped_module.", "")
            with FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT, save_policy):
                cpu_state_dict = {**cpu_state_dict, **{f"{prefix}.{k}": v for k, v in module.state_dict().items()}}
    else:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy):
            cpu_state_dict = model.state_dict()
            if dist.get_rank() == 0:
                torch.save(cpu_state_dict, "/dev/null")
    return losses, cpu_state_dict
"""


def test_qlora_no_sync_as_a_value_and_a_shared_config_are_migrated() -> None:
    """Before, `sync_context = model.no_sync()` stayed as written, unreported (FSDP2 has no no_sync: an
    AttributeError at the first accumulation step), and `save_policy`, given to two blocks, stayed reported."""
    result = migrate_source(_QLORA)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert _fsdp1_names(ast.parse(out)) == set() and "save_policy" not in out
    assert "sync_context = without_gradient_sync(model)" in out and ".no_sync()" not in out
    full_rank0 = "StateDictOptions(full_state_dict=True, cpu_offload=True)"
    assert f"get_model_state_dict(module, options={full_rank0}).items()" in out


def _qlora(fsdp1_source: str, migrated_source: str) -> list[Any]:
    """On a rank: each program's losses and its state dicts, the whole model's and (FSDP2's) the LoRA units' taken
    one by one. torch 2.13's FSDP1 fails leaving a state_dict_type block on a unit that is not the root (KeyError:
    None), so the oracle for the units' weights is its whole-model FULL state dict."""
    runs = []
    for source in (fsdp1_source, migrated_source):
        scope: dict[str, Any] = {}
        exec(compile(source, "program.py", "exec"), scope)
        runs.append(scope["run"])
    losses1, full1 = runs[0](lora_only=False)
    losses2, full2 = runs[1](lora_only=False)
    _, lora2 = runs[1](lora_only=True)
    return [losses1, full1, losses2, full2, lora2]


def test_qlora_trains_and_saves_what_fsdp1_does(ranks: Any) -> None:
    """The losses with gradients accumulated under the context entered later, the full state dict (rank 0's, and
    nothing elsewhere), and the LoRA weights taken unit by unit: FSDP1's keys and values."""
    migrated = migrate_source(_QLORA).migrated
    for rank, (losses1, full1, losses2, full2, lora2) in enumerate(ranks(_qlora, 2, _QLORA, migrated)):
        assert losses2 == losses1 and len(set(losses1)) == 6
        assert (full1 == {}) == (rank == 1) and _equal(full2, full1)
        assert (lora2 == {}) == (rank == 1)
        if rank == 0:
            assert sorted(lora2) == [f"{b}.lora.lora_AB.{i}.weight" for b in (0, 1) for i in (0, 1)]
            assert _equal(lora2, {k: v for k, v in full1.items() if "lora_AB" in k})


def test_safetensors_save_file_under_a_block_lets_the_block_go() -> None:
    """save_file writes the tensors it is handed and sees nothing of the model (fsdp_qlora saves with it): before,
    it counted as a save the tool cannot see into, and kept the block and the whole file."""
    source = _QLORA.replace("torch.save(cpu_state_dict", "save_file(cpu_state_dict").replace(
        "from contextlib", "from safetensors.torch import save_file\nfrom contextlib"
    )
    result = migrate_source(source)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    assert "cpu_state_dict = get_model_state_dict(model, options=" in result.migrated
    kept = migrate_source(source.replace("save_file(cpu_state_dict", "write_checkpoint(cpu_state_dict"))
    assert kept.migrated == kept.source
    assert any("a save or load this tool cannot see into" in f.why for f in kept.findings)


# fms-fsdp's Checkpointer, the model a parameter of each method.
_FMS = """
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Checkpointer:
    def load(self, model, optimizer, path, single_file=False, strict=True, is_compiled=False):
        if single_file:
            checkpoint_data = torch.load(path, map_location="cpu", weights_only=True)
            if is_compiled:
                model._orig_mod.load_state_dict(checkpoint_data.get("model_state"), strict=strict)
            else:
                model.load_state_dict(checkpoint_data.get("model_state"), strict=strict)
            return model, optimizer
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model_ckp = {"model_state": model.state_dict()}
            dcp.load(model_ckp, storage_reader=dcp.FileSystemReader(path))
            model.load_state_dict(model_ckp["model_state"])
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            optim_state = load_sharded_optimizer_state_dict(
                model_state_dict=model.state_dict(),
                optimizer_key="optimizer_state",
                storage_reader=dcp.FileSystemReader(path),
            )
        flattened_osd = FSDP.optim_state_dict_to_load(model, optimizer, optim_state["optimizer_state"])
        optimizer.load_state_dict(flattened_osd)
        return model, optimizer

    def save(self, model, optimizer, path):
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model_state = model.state_dict()
            optim_state = FSDP.sharded_optim_state_dict(model, optimizer)
        state_dict = {"model_state": model_state, "optimizer_state": optim_state}
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(path))

    def save_single_file(self, model, path, is_compiled=False):
        with FSDP.state_dict_type(
            model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        ):
            if is_compiled:
                model_state = model._orig_mod.state_dict()
            else:
                model_state = model.state_dict()
        if dist.get_rank() == 0:
            torch.save({"model_state": model_state}, path)
        dist.barrier()


def build():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    wrapped = FSDP(net, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=0.05)


def train(net, optim, steps, seed):
    losses = []
    for step in range(steps):
        data = torch.Generator().manual_seed(seed + 10 * step + dist.get_rank())
        loss = net(torch.randn(4, 8, generator=data)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def save(path):
    net, optim = build()
    train(net, optim, 2, 0)
    Checkpointer().save(net, optim, path)
    Checkpointer().save_single_file(net, path + ".pth")
    return train(net, optim, 3, 100)


def resume(path):
    net, optim = build()
    net, optim = Checkpointer().load(net, optim, path)
    after = train(net, optim, 3, 100)
    fresh, fresh_optim = build()  # the single file, one tensor left out (strict=False)
    if dist.get_rank() == 0:
        full = torch.load(path + ".pth", weights_only=True)["model_state"]
        torch.save({"model_state": {k: v for k, v in full.items() if not k.startswith("1.")}}, path + ".part")
    dist.barrier()
    fresh, fresh_optim = Checkpointer().load(fresh, fresh_optim, path + ".part", single_file=True, strict=False)
    return after + train(fresh, fresh_optim, 2, 7)
"""


def test_fms_checkpointer_is_migrated() -> None:
    """Before, the block around `model._orig_mod.state_dict()` kept the whole file, and once it went the single-file
    load (`load_state_dict(sd, strict=strict)` outside the blocks, on the parameter) and the to-load call after its
    SHARDED block would have been left: a full state dict into DTensors, ShardedTensors into FSDP2's optimizer.
    (`model` is no name the file wraps: it is known FSDP1's only from the function's blocks.)"""
    result = migrate_source(_FMS)
    assert "model" not in _wrapped_names(_FMS)
    assert result.findings == [], [f.format("x.py") for f in result.findings]
    out = result.migrated
    assert _fsdp1_names(ast.parse(out)) == set() and "load_sharded_optimizer_state_dict" not in out
    full = "StateDictOptions(full_state_dict=True, strict=strict)"
    assert f'set_model_state_dict(model._orig_mod, checkpoint_data.get("model_state"), options={full})' in out
    assert f'set_model_state_dict(model, checkpoint_data.get("model_state"), options={full})' in out
    assert "model_state = get_model_state_dict(model._orig_mod, options=StateDictOptions(full_state_dict=True," in out
    assert (
        'optim_state = {"optimizer_state": get_optimizer_state_dict(model, optimizer, options=StateDictOptions())}'
        in out
    )
    assert (
        'set_optimizer_state_dict(model, optimizer, optim_state["optimizer_state"], options=StateDictOptions())' in out
    )


def test_fms_checkpointer_resumes_as_fsdp1_does(ranks: Any, tmp_path: Path) -> None:
    """From torch's FSDP1 checkpoints (SHARDED through DCP, and rank 0's single file), both programs resume: the
    sharded resume goes on as FSDP1 went on after saving, and a model loaded from the single file without one
    tensor (strict=False) trains as FSDP1's."""
    migrated = migrate_source(_FMS).migrated
    for after_save, fsdp1, fsdp2 in ranks(_resumed, 2, _FMS, migrated, str(tmp_path / "ckpt")):
        assert fsdp1[:3] == pytest.approx(after_save, rel=1e-6)  # (the oracle resumes as it went on)
        assert fsdp2 == pytest.approx(fsdp1, rel=1e-5)


def test_fsdp1_attributes_and_a_type_set_elsewhere_are_reported() -> None:
    """`model.process_group` (FSDP1's, handed to DCP by fms-fsdp's save) has no FSDP2 counterpart on the module; a
    state-dict call on a function's model outside its blocks, in a program that calls set_state_dict_type, may run
    under any type. Both are reported, the lines left as written."""
    source = _FMS.replace(
        "storage_writer=dcp.FileSystemWriter(path))",
        "storage_writer=dcp.FileSystemWriter(path),\n                 process_group=model.process_group)",
    )
    result = migrate_source(source)
    assert [(f.what, f.line) for f in result.findings] == [("`model.process_group`", 40)]
    assert "process_group=model.process_group" in result.migrated
    setter = "\n\ndef elsewhere(model):\n    FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)\n"
    program = migrate_program({"a.py": _FMS, "b.py": _FMS.split("\n\n\nclass")[0] + setter})
    reported = {(f.what, f.line) for f in program.results["a.py"].findings}
    assert reported == {("`model._orig_mod.load_state_dict(...)`", 16), ("`model.load_state_dict(...)`", 18)}


# fms-fsdp's policies module and its get_policies(): the values reach FSDP(...) in another file at run time.
_POLICY_FILES = {
    "policies/__init__.py": "from .mixed_precision import *\nfrom .wrapping import get_wrapper\n",
    "policies/mixed_precision.py": textwrap.dedent(
        """
        import torch
        from torch.distributed.fsdp import MixedPrecision

        bfSixteen = MixedPrecision(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.bfloat16,
            buffer_dtype=torch.bfloat16,
        )

        fp32_policy = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
        """
    ),
    "policies/wrapping.py": textwrap.dedent(
        """
        import functools

        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy


        def get_wrapper(block):
            return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block})
        """
    ),
    "policies/train_utils.py": textwrap.dedent(
        """
        from torch.distributed.fsdp import ShardingStrategy

        from policies import *


        def get_policies(cfg, block):
            mixed_precision_policy = bfSixteen if cfg["bf16"] else None
            if cfg["shard"] == "fsdp":
                sharding_strategy = ShardingStrategy.FULL_SHARD
            else:
                sharding_strategy = ShardingStrategy.SHARD_GRAD_OP
            return mixed_precision_policy, get_wrapper(block), sharding_strategy
        """
    ),
}

_MAIN = """
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from policies.train_utils import get_policies


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 1.0 / 3))

    def forward(self, x):
        return self.lin(x.to(self.lin.weight.dtype)) * self.scale


def run():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    cfg = {"bf16": True, "shard": "fsdp"}
    mixed_precision_policy, wrapping_policy, sharding_strategy_policy = get_policies(cfg, Block)
    model = FSDP(
        model,
        auto_wrap_policy=wrapping_policy,
        mixed_precision=mixed_precision_policy,
        sharding_strategy=sharding_strategy_policy,
        device_id=torch.device("cpu"),
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(4):
        torch.manual_seed(1 + 10 * dist.get_rank() + step)
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, sorted({str(b.dtype) for b in model.buffers()})
"""


def test_policies_modules_read_at_run_time_stay_as_they_are(ranks: Any, tmp_path: Path) -> None:
    """Before, the policies module reported its MixedPrecision policies (returned by a function: they may reach a
    construction that stays FSDP1, and nothing casts their buffers) and the policy builder reported
    transformer_auto_wrap_policy. The program's only construction reads both at run time (fsdp1_options,
    apply_fully_shard), which take FSDP1's values as they are: nothing is reported, those files are not touched, and
    the program trains as torch's FSDP1 did (bf16, the buffers cast)."""
    files = {**_POLICY_FILES, "train.py": _MAIN}
    results = _migrated(files, tmp_path)
    for name, result in results.items():
        assert result.findings == [], [f.format(name) for f in result.findings]
        assert result.changed == (name == "train.py"), name
    train = results["train.py"].migrated
    assert "apply_fully_shard(model, wrapping_policy, **fsdp_kwargs)" in train
    assert "fsdp1_options(mixed_precision=mixed_precision_policy, sharding_strategy=sharding_strategy_policy)" in train
    migrated = {name: result.migrated for name, result in results.items()}
    for (losses1, buffers1), (losses2, buffers2) in ranks(_both_programs, 2, files, migrated):
        assert buffers1 == buffers2 == ["torch.bfloat16"]
        torch.testing.assert_close(losses2, losses1, rtol=1e-3, atol=0)  # bf16 (test_migrate_corpus.BF16_RTOL)
    alone = migrate_source(_POLICY_FILES["policies/wrapping.py"])  # without the program: still reported
    assert [f.what for f in alone.findings] == ["FSDP1 API `transformer_auto_wrap_policy` left in place"]
