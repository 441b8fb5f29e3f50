"""Lightning's FSDPStrategy on 2 CPU ranks, with Fabric and with the Trainer: train, clip, save, load or resume, train
on, for each configuration; see common.py for the contract with test_frameworks.py.

Lightning refuses FSDP on CPU by an exact type check (`type(strategy) is FSDPStrategy`), so a subclass is used; with
torch's FSDP1 (the oracle) the subclass also passes device_id=cpu, which torch's FSDP1 needs on CPU and Lightning
cannot pass (it gives `root_device.index`, None on CPU).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from common import (
    Block,
    Net,
    batch,
    check_impl,
    checksum,
    full_params,
    loss_of,
    max_difference,
    parse_args,
    run_all,
)


@dataclass(frozen=True)
class Run:
    name: str
    api: str  # fabric | trainer
    state_dict_type: str  # full | sharded
    precision: str = "32-true"  # 32-true | bf16-mixed | bf16-true (bf16 weights)
    use_orig_params: bool = True  # Lightning's default
    activation_checkpointing: bool = False


RUNS = [
    Run("fabric_sharded", "fabric", "sharded"),
    Run("fabric_full_flat", "fabric", "full", use_orig_params=False),
    Run("fabric_full_bf16_ac", "fabric", "full", "bf16-mixed", activation_checkpointing=True),
    Run("fabric_sharded_bf16_flat_ac", "fabric", "sharded", "bf16-mixed", False, True),
    Run("fabric_full_bf16_weights", "fabric", "full", "bf16-true"),
    Run("trainer_sharded", "trainer", "sharded"),
    Run("trainer_full_bf16_ac", "trainer", "full", "bf16-mixed", activation_checkpointing=True),
    Run("trainer_sharded_flat_bf16_weights", "trainer", "sharded", "bf16-true", False),
]


@contextlib.contextmanager
def cpu_device_id(impl: str) -> Iterator[None]:
    """torch's FSDP1 only: device_id=cpu while Lightning wraps (it imports the class inside the method)."""
    if impl == "ours":
        yield
        return
    import torch.distributed.fsdp as torch_fsdp

    original = torch_fsdp.FullyShardedDataParallel

    class OnCPU(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args, device_id=None, **kwargs):  # type: ignore[no-untyped-def]
            super().__init__(*args, device_id=torch.device("cpu") if device_id is None else device_id, **kwargs)

    torch_fsdp.FullyShardedDataParallel = OnCPU
    try:
        yield
    finally:
        torch_fsdp.FullyShardedDataParallel = original


def strategy(run: Run, impl: str):  # type: ignore[no-untyped-def]
    if run.api == "fabric":
        from lightning.fabric.strategies import FSDPStrategy

        class FabricOnCPU(FSDPStrategy):
            def setup_module(self, module):  # type: ignore[no-untyped-def]
                with cpu_device_id(impl):
                    return super().setup_module(module)

        cls = FabricOnCPU
    else:
        from lightning.pytorch.strategies import FSDPStrategy as TrainerStrategy

        class TrainerOnCPU(TrainerStrategy):
            def _setup_model(self, model):  # type: ignore[no-untyped-def]
                with cpu_device_id(impl):
                    return super()._setup_model(model)

        cls = TrainerOnCPU
    return cls(
        auto_wrap_policy={Block},
        state_dict_type=run.state_dict_type,
        process_group_backend="gloo",
        use_orig_params=run.use_orig_params,
        activation_checkpointing_policy={Block} if run.activation_checkpointing else None,
    )


def input_dtype(run: Run) -> torch.dtype:
    return torch.bfloat16 if run.precision == "bf16-true" else torch.float32


def fabric_run(run: Run, impl: str, path: str) -> dict:
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy(run, impl), precision=run.precision)
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module():
        net = Net()
    model = fabric.setup_module(net)
    check_impl(impl, model._forward_module)
    optim = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, grad_norms = [], []
    for step in range(3):
        x, y = batch(step, input_dtype(run))
        loss = loss_of(model(x), y)
        fabric.backward(loss)
        grad_norms.append(float(fabric.clip_gradients(model, optim, max_norm=1.0)))
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    _remove(path, fabric.global_rank)
    fabric.barrier()
    fabric.save(path, {"model": model, "optimizer": optim, "step": 3})
    saved = full_params(model._forward_module)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state = {"model": model, "optimizer": optim, "step": 0}
    fabric.load(path, state)
    restored = full_params(model._forward_module)
    x, y = batch(3, input_dtype(run))
    loss = loss_of(model(x), y)
    fabric.backward(loss)
    optim.step()
    optim.zero_grad()
    return dict(
        config=asdict(run),
        fsdp=check_impl(impl, model._forward_module),
        losses=losses,
        grad_norms=grad_norms,
        step=state["step"],
        restored_max_difference=max_difference(saved, restored),
        loss_after_resume=loss.item(),
        params_after_resume=checksum(full_params(model._forward_module)),
    )


def trainer_run(run: Run, impl: str, path: str) -> dict:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net().to(input_dtype(run))  # bf16-true: the Trainer does not convert a module built outside init
            self.losses: list[float] = []
            self.grad_norms: list[float] = []

        def training_step(self, data, index):  # type: ignore[no-untyped-def]
            x, y = data
            # the dtype the root unit computes in: on CPU Lightning runs bf16-mixed without autocast, and the Trainer
            # calls training_step, not the root's forward, so FSDP does not cast the inputs either
            loss = loss_of(self.net(x.to(self.net.embed.weight.dtype)), y)
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer):  # type: ignore[no-untyped-def]
            # Lightning refuses gradient_clip_val with FSDP (any device): clip through FSDP itself
            self.grad_norms.append(float(self.trainer.model.clip_grad_norm_(1.0)))

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.trainer.model.parameters(), lr=1e-2)

    def loader():  # type: ignore[no-untyped-def]
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(80, 8, generator=generator), torch.randn(80, 4, generator=generator)
        )
        return torch.utils.data.DataLoader(data, batch_size=8)

    def trainer(steps: int):  # type: ignore[no-untyped-def]
        return L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy(run, impl),
            precision=run.precision,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=os.path.dirname(path),
        )

    torch.manual_seed(0)
    first, module = trainer(3), Module()
    first.fit(module, loader())
    check_impl(impl, first.model)
    _remove(path, first.global_rank)
    first.strategy.barrier()
    first.save_checkpoint(path)
    first.strategy.barrier()
    torch.manual_seed(1)  # a different initialisation: everything must come from the checkpoint
    second, resumed = trainer(5), Module()
    second.fit(resumed, loader(), ckpt_path=path)
    return dict(
        config=asdict(run),
        fsdp=check_impl(impl, first.model),
        losses=module.losses,
        grad_norms=module.grad_norms,
        step=second.global_step,
        losses_after_resume=resumed.losses,
        params_after_resume=checksum(full_params(second.model)),
    )


def _remove(path: str, rank: int) -> None:
    if rank == 0 and os.path.exists(path):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def main() -> None:
    run_all(
        parse_args(),
        RUNS,
        lambda run, impl, path: (fabric_run if run.api == "fabric" else trainer_run)(run, impl, path),
        ".ckpt",
    )


if __name__ == "__main__":
    main()
