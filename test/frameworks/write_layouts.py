"""Write the FSDP checkpoints Accelerate or Lightning save, with torch's own FSDP1 (what their users have), for
test_convert_layouts.py: `torchrun --nproc-per-node=2 write_layouts.py --library accelerate|lightning --out DIR`.

Each layout goes to DIR/<name>/ with DIR/<name>/expected.pt beside it (rank 0): the oracle, the trained model's FULL
model and optimizer state dicts (keyed by FQN), taken from torch's FSDP1 itself. Accelerate's run also writes
DIR/layout/, a LOCAL checkpoint of the same model and wrapping saved by fsdp_legacy (the layout that reads torch's
LOCAL checkpoints offline).
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from common import Block, Net, batch, exit_now, loss_of, patch_torch_fsdp1_for_cpu


def oracle(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    """The FULL model and optimizer state dicts (clean FQNs), on every rank."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
        ):
            return {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "optim": FSDP.optim_state_dict(model, optim),
            }


def save_oracle(directory: Path, expected: dict) -> None:
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(expected, directory / "expected.pt")


# --------------------------------------------------------------------------------------------------------------------
# Accelerate: save_state under each state_dict_type


def accelerate_layout(out: Path, name: str, state_dict_type: str, use_orig_params: bool, use_dcp: bool = True) -> None:
    """save_state; with use_dcp=False, the per-rank files of save_fsdp_model / save_fsdp_optimizer (Accelerate's
    option for large worlds, which save_state does not expose)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    AcceleratorState._reset_state(reset_partial_state=True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        state_dict_type=state_dict_type,
        use_orig_params=use_orig_params,
    )
    # Accelerate enables its FSDP plugin for GPU-like backends only (else DDP): set the state as its FSDP branch would
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    acc.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    torch.manual_seed(0)
    model = acc.prepare(Net())
    optim = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(2):
        x, y = batch(step)
        acc.backward(loss_of(model(x), y))
        optim.step()
        optim.zero_grad()
    if use_dcp:
        acc.save_state(str(out / name))
    else:
        from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

        save_fsdp_model(plugin, acc, model, str(out / name), use_dcp=False)
        save_fsdp_optimizer(plugin, acc, optim, model, str(out / name), use_dcp=False)
    save_oracle(out / name, oracle(model, optim))
    acc.wait_for_everyone()


def our_layout(out: Path) -> None:
    """fsdp_legacy's LOCAL checkpoint of Net wrapped as the plugin wraps it: its layout records."""
    import fsdp_legacy
    from fsdp_legacy.state import dcp_checkpoint

    model = fsdp_legacy.FullyShardedDataParallel(Net(), auto_wrap_policy=fsdp_legacy.wrap.ModuleWrapPolicy({Block}))
    with fsdp_legacy.FullyShardedDataParallel.state_dict_type(model, fsdp_legacy.StateDictType.LOCAL_STATE_DICT):
        dcp_checkpoint.save({"model": model.state_dict()}, str(out / "layout"))  # records in its side file


def accelerate(out: Path) -> None:
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"  # else Accelerate passes device_id=cpu:0, which FSDP1 refuses
    accelerate_layout(out, "full", "FULL_STATE_DICT", False)
    accelerate_layout(out, "sharded", "SHARDED_STATE_DICT", True)
    accelerate_layout(out, "sharded_per_rank", "SHARDED_STATE_DICT", False, use_dcp=False)
    accelerate_layout(out, "local", "LOCAL_STATE_DICT", False)
    our_layout(out)


# --------------------------------------------------------------------------------------------------------------------
# Lightning: Fabric's save and the Trainer's save_checkpoint, sharded and full


def lightning_strategy(api: str, state_dict_type: str):  # type: ignore[no-untyped-def]
    """FSDPStrategy on CPU: Lightning refuses FSDP on CPU by an exact type check, so a subclass; torch's FSDP1 needs
    device_id=cpu there, which Lightning does not pass (root_device.index is None on CPU)."""
    import torch.distributed.fsdp as torch_fsdp

    def wrapping(setup):  # type: ignore[no-untyped-def]
        def run(self, module):  # type: ignore[no-untyped-def]
            original = torch_fsdp.FullyShardedDataParallel

            class OnCPU(original):  # type: ignore[misc, valid-type]
                def __init__(self, *args, device_id=None, **kwargs):  # type: ignore[no-untyped-def]
                    super().__init__(*args, device_id=device_id or torch.device("cpu"), **kwargs)

            torch_fsdp.FullyShardedDataParallel = OnCPU
            try:
                return setup(self, module)
            finally:
                torch_fsdp.FullyShardedDataParallel = original

        return run

    if api == "fabric":
        from lightning.fabric.strategies import FSDPStrategy

        cls = type("FabricOnCPU", (FSDPStrategy,), {"setup_module": wrapping(FSDPStrategy.setup_module)})
    else:
        from lightning.pytorch.strategies import FSDPStrategy as TrainerStrategy

        cls = type("TrainerOnCPU", (TrainerStrategy,), {"_setup_model": wrapping(TrainerStrategy._setup_model)})
    return cls(auto_wrap_policy={Block}, state_dict_type=state_dict_type, process_group_backend="gloo")


def fabric_layout(out: Path, state_dict_type: str) -> None:
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=lightning_strategy("fabric", state_dict_type))
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(Net())
    optim = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(2):
        x, y = batch(step)
        fabric.backward(loss_of(model(x), y))
        optim.step()
        optim.zero_grad()
    path = out / f"fabric_{state_dict_type}"
    path.mkdir(parents=True, exist_ok=True)
    fabric.save(path / "checkpoint.ckpt", {"net": model, "adam": optim, "step": 2})
    save_oracle(path, oracle(model._forward_module, optim.optimizer))
    fabric.barrier()


def trainer_layout(out: Path, state_dict_type: str) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, data, index):  # type: ignore[no-untyped-def]
            return loss_of(self.net(data[0]), data[1])

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.trainer.model.parameters(), lr=1e-2)

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=generator), torch.randn(32, 4, generator=generator)
    data = torch.utils.data.TensorDataset(x, y)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_strategy("trainer", state_dict_type),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    torch.manual_seed(0)
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=8))
    path = out / f"trainer_{state_dict_type}"
    path.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(path / "checkpoint.ckpt")
    save_oracle(path, oracle(trainer.strategy.model, trainer.optimizers[0]))
    trainer.strategy.barrier()


def lightning(out: Path) -> None:
    for state_dict_type in ("sharded", "full"):
        fabric_layout(out, state_dict_type)
        trainer_layout(out, state_dict_type)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", choices=["accelerate", "lightning"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    patch_torch_fsdp1_for_cpu()
    args.out.mkdir(parents=True, exist_ok=True)
    {"accelerate": accelerate, "lightning": lightning}[args.library](args.out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    exit_now()


if __name__ == "__main__":
    main()
