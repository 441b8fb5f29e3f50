"""One rank of a large world, played by one process: the worker of tools/bench_scale.py.

torch's fake process group makes this process rank `rank` of `world_size` ranks: every implementation runs the rank's
whole program (shapes, allocations, frees, copies, compute, the caching allocator) on real tensors; only the
collectives move no data. The fake group leaves a collective's output as allocated, so the rig fills it as if every
rank held this rank's values (an all-gather repeats the local shard, a reduce-scatter keeps this rank's chunk): every
implementation computes on initialised, finite values drawn the same way, at the cost of one local copy per
collective. Denormals are flushed so that no value can make a CPU step slower for one implementation than another.

Run by bench_scale.py as `python tools/scale_rig.py CONFIG_JSON RESULT_JSON`, one process per implementation.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

IMPLS = ("ours", "torch_fsdp1", "fsdp2")


@dataclass(frozen=True)
class RigConfig:
    impl: str  # ours | torch_fsdp1 | fsdp2 | estimate (ours, predicted on fake tensors)
    preset: str
    layers: int | None  # the first N decoder layers; None: all
    world_size: int
    rank: int
    device: str  # cpu | cuda
    batch: tuple[int, int]
    sharding: str  # FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD
    shard_group_size: int  # HYBRID_SHARD: ranks per shard group (a node)
    bf16: bool
    activation_checkpointing: bool
    cpu_offload: bool
    use_orig_params: bool
    steps: int  # timed steps, after two untimed ones
    lora_rank: int = 0  # > 0: every decoder linear layer frozen, with adapters of this rank (fsdp_legacy/cli/lora.py)
    checkpoint: str = ""  # full | sharded: after training, take the model's and the optimizer's state dicts, measured


@dataclass
class RigResult:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    alloc_retries: int
    step_s: float
    step_times: list[float]
    loss: float
    save_peak_bytes: int = 0  # the most memory live while the checkpoint was taken (--checkpoint)
    save_held_bytes: int = 0  # what the state dicts hold on this rank


# --- collectives that fill their outputs -------------------------------------------------------------------------


def _rank_in(group: Any) -> int:
    return dist.get_rank(group) if group is not None else dist.get_rank()


def _filling_all_gather(original: Any, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    work = original(output, input, *args, **kwargs)
    shard = input.reshape(1, -1)
    if shard.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
        shard = shard.clone()  # FSDP2 gathers in place: its input is a piece of the output
    output.view(-1, input.numel()).copy_(shard)
    return work


def _filling_reduce_scatter(original: Any, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    work = original(output, input, *args, **kwargs)
    group = kwargs.get("group", args[1] if len(args) > 1 else None)
    output.view(-1).copy_(input.reshape(-1, output.numel())[_rank_in(group)])
    return work


def _filling_all_gather_object(original: Any, object_list: list[Any], obj: Any, *args: Any, **kwargs: Any) -> Any:
    work = original(object_list, obj, *args, **kwargs)
    object_list[:] = [obj] * len(object_list)  # every rank sent what this one did
    return work


def install_filling_collectives() -> None:
    """Before fsdp_legacy is imported (it binds the collectives at import), wrap the single-tensor collectives of
    every torch release (2.13 renamed them) so that the fake group's outputs hold values; all_gather_object (the
    checkpoint's exchanges of state names and shapes) gets this rank's object from every rank."""
    dist.all_gather_object = partial(_filling_all_gather_object, dist.all_gather_object)
    for name, filler in (
        ("all_gather_single", _filling_all_gather),
        ("all_gather_into_tensor", _filling_all_gather),
        ("reduce_scatter_single", _filling_reduce_scatter),
        ("reduce_scatter_tensor", _filling_reduce_scatter),
    ):
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, partial(filler, original))


# --- the model and the three implementations ----------------------------------------------------------------------


def _strip(name: str) -> str:
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def rig_device(cfg: RigConfig) -> torch.device:
    return torch.device(cfg.device, 0) if cfg.device == "cuda" else torch.device("cpu")


def build_model(cfg: RigConfig, device: torch.device | str = "meta") -> torch.nn.Module:
    """The preset's model on `device` (meta: materialised unit by unit when wrapped), activation checkpointing
    applied if asked."""
    from fsdp_legacy.cli.llama import PRESETS, DecoderLayer, Llama

    with torch.device(device):
        model = Llama(PRESETS[cfg.preset].with_layers(cfg.layers))
    if cfg.lora_rank:
        from fsdp_legacy.cli.lora import to_lora

        to_lora(model, cfg.lora_rank)
    if cfg.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, DecoderLayer))
    return model


def materialiser(model: torch.nn.Module, device: torch.device) -> Any:
    """FSDP1's param_init_fn: the module's own meta parameters on `device`, filled by init_weights (tied
    parameters stay tied: a parameter met twice gets the same new one)."""
    from fsdp_legacy.cli.llama import init_weights

    names = {module: _strip(name) for name, module in model.named_modules()}
    done: dict[torch.nn.Parameter, torch.nn.Parameter] = {}

    def init(module: torch.nn.Module) -> None:
        for attr, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if param not in done:
                done[param] = torch.nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
            module._parameters[attr] = done[param]
        init_weights(module, names.get(module, ""))

    return init


def fsdp1_kwargs(cfg: RigConfig, device: torch.device, mesh: bool = True) -> dict[str, Any]:
    """The FSDP1 options, the same objects for ours and torch's (ours accepts torch's configs); HYBRID_SHARD's mesh
    unless `mesh` is False (the estimator makes its own, in its fake world)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy

    from fsdp_legacy.cli.llama import DecoderLayer
    from fsdp_legacy.wrap import ModuleWrapPolicy

    kwargs: dict[str, Any] = {
        "auto_wrap_policy": ModuleWrapPolicy({DecoderLayer}),
        "sharding_strategy": ShardingStrategy[cfg.sharding],
        "use_orig_params": cfg.use_orig_params,
        "device_id": device,
    }
    if cfg.bf16:
        kwargs["mixed_precision"] = MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    if cfg.cpu_offload:
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    if cfg.sharding == "HYBRID_SHARD" and mesh:
        kwargs["device_mesh"] = init_device_mesh(device.type, hybrid_shape(cfg), mesh_dim_names=("replicate", "shard"))
    return kwargs


def hybrid_shape(cfg: RigConfig) -> tuple[int, int]:
    shard = min(cfg.shard_group_size, cfg.world_size)
    if cfg.world_size % shard:
        raise SystemExit(f"HYBRID_SHARD: --shard-group-size {shard} must divide --world-size {cfg.world_size}")
    return cfg.world_size // shard, shard


def wrap(cfg: RigConfig, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    if cfg.impl == "ours":
        from fsdp_legacy import FullyShardedDataParallel

        return FullyShardedDataParallel(model, param_init_fn=materialiser(model, device), **fsdp1_kwargs(cfg, device))
    if cfg.impl == "torch_fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP  # the oracle

        return TorchFSDP(model, param_init_fn=materialiser(model, device), **fsdp1_kwargs(cfg, device))
    return wrap_fsdp2(cfg, model, device)


def wrap_fsdp2(cfg: RigConfig, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """fully_shard on the same units with the equivalent options: reshard_after_forward for FULL_SHARD, a 2-D mesh
    for HYBRID_SHARD."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from fsdp_legacy.cli.llama import DecoderLayer, init_weights

    if cfg.sharding == "HYBRID_SHARD":
        mesh = init_device_mesh(device.type, hybrid_shape(cfg), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (cfg.world_size,))
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": cfg.sharding != "SHARD_GRAD_OP"}
    if cfg.bf16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if cfg.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for module in model.modules():
        if isinstance(module, DecoderLayer):
            fully_shard(module, **options)
    fully_shard(model, **options)
    model.to_empty(device="cpu" if cfg.cpu_offload else device)
    for name, module in model.named_modules():
        init_weights(module, _strip(name))
    return model


# --- the checkpoint -----------------------------------------------------------------------------------------------


def take_checkpoint(cfg: RigConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """The model's and the optimizer's state dicts as frameworks take them: FULL (rank 0 keeps them; offloaded to the
    CPU from a GPU) or SHARDED; FSDP2 through torch.distributed.checkpoint.state_dict's get_state_dict."""
    full = cfg.checkpoint == "full"
    offload = full and cfg.device == "cuda"  # (offload_to_cpu on a CPU run is torch FSDP1's CPU bug: left off)
    if cfg.impl == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=offload))
    if cfg.impl == "ours":
        from fsdp_legacy import FullyShardedDataParallel as wrapper
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as wrapper  # type: ignore[assignment]
    configs = fsdp1_save_configs(full, offload)
    with wrapper.state_dict_type(model, *configs):
        return model.state_dict(), wrapper.optim_state_dict(model, optimizer)


def fsdp1_save_configs(full: bool, offload_to_cpu: bool) -> tuple[Any, ...]:
    """FSDP1's (state_dict_type, model config, optimizer config) of a checkpoint as frameworks take it: FULL with
    rank0_only, or SHARDED."""
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )

    if full:
        return (
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=True),
        )
    return StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()


def local_tensors(value: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor a (nested) state dict holds on this rank, by path: ShardedTensors' and DTensors' local pieces."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in local_tensors(item, f"{path}/{key}").items()}
    if isinstance(value, list | tuple):
        return {k: v for i, item in enumerate(value) for k, v in local_tensors(item, f"{path}/{i}").items()}
    if hasattr(value, "local_shards"):
        return {f"{path}#{i}": shard.tensor for i, shard in enumerate(value.local_shards())}
    if hasattr(value, "to_local"):
        return {path: value.to_local()}
    return {path: value} if isinstance(value, torch.Tensor) else {}


def state_dict_nbytes(value: Any, device: str | None = None) -> int:
    """Bytes of the distinct storages a (nested) state dict holds on this rank (on `device`, if given), a storage
    shared by several entries once."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in local_tensors(value).values()
        if device is None or t.device.type == device
    }
    return sum(storages.values())


# --- the measurement ----------------------------------------------------------------------------------------------


def adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (LoRA: the adapters only, as fine-tuning recipes pass them)."""
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-4)


def batch(cfg: RigConfig, device: torch.device) -> torch.Tensor:
    from fsdp_legacy.cli.llama import PRESETS

    generator = torch.Generator().manual_seed(1234 + cfg.rank)
    ids = torch.randint(0, PRESETS[cfg.preset].vocab_size, cfg.batch, generator=generator)
    return ids.to(device)


def run(cfg: RigConfig) -> RigResult:
    from fsdp_legacy.cli.llama import next_token_loss
    from fsdp_legacy.memory import MemoryTracker
    from fsdp_legacy.memory.fake_world import fake_process_group

    device = rig_device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ids = batch(cfg, device)
    with fake_process_group(cfg.world_size, cfg.rank):
        model = build_model(cfg)
        tracker = MemoryTracker() if device.type == "cpu" else None  # CUDA: the allocator's own statistics
        if tracker is not None:
            tracker.__enter__()
        wrapped = wrap(cfg, model, device)
        if tracker is not None:
            tracker.track(wrapped)
        optimizer = adamw(wrapped.parameters())

        def step() -> float:
            loss = next_token_loss(wrapped(ids), ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return float(loss.detach())

        losses = [step(), step()]  # the second has optimizer state: the steady state's peak
        save = (0, 0)
        if tracker is not None:
            allocated = tracker.peak(device="cpu")
            if cfg.checkpoint:  # on the CPU while the tracker counts (it would slow the timed steps)
                tracker.reset_peak()
                saved = take_checkpoint(cfg, wrapped, optimizer)
                save = (tracker.peak(device="cpu"), state_dict_nbytes(saved, "cpu"))
                del saved
            tracker.__exit__(None, None, None)
        times = []
        for _ in range(cfg.steps):
            start = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - start)
        if device.type == "cuda":
            stats = torch.cuda.memory_stats(device)
            allocated, reserved = stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]
            retries = stats.get("num_alloc_retries", 0)
            if cfg.checkpoint:  # on the GPU after the timed steps, its own peak
                torch.cuda.reset_peak_memory_stats(device)
                saved = take_checkpoint(cfg, wrapped, optimizer)
                torch.cuda.synchronize()
                save = (torch.cuda.max_memory_allocated(device), state_dict_nbytes(saved))
                del saved
        else:
            reserved = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak resident set
            retries = 0
    median = statistics.median(times) if times else 0.0
    return RigResult(allocated, reserved, retries, median, times, losses[-1], *save)


def estimate(cfg: RigConfig) -> int:
    """Our estimator's prediction of the same configuration: fake tensors, the same FSDP options, AdamW, 2 steps."""
    from fsdp_legacy.cli.llama import PRESETS, next_token_loss
    from fsdp_legacy.memory import estimate_memory

    device = rig_device(cfg)

    def loss_fn(model: torch.nn.Module, step: int) -> torch.Tensor:
        ids = torch.randint(0, PRESETS[cfg.preset].vocab_size, cfg.batch, device=device)
        return next_token_loss(model(ids), ids)

    kwargs = fsdp1_kwargs(cfg, device, mesh=False)
    profile = estimate_memory(
        partial(build_model, cfg, device),
        loss_fn,
        cfg.world_size,
        kwargs,
        adamw,
        steps=2,
        rank=cfg.rank,
        hybrid_shape=hybrid_shape(cfg) if cfg.sharding == "HYBRID_SHARD" else None,
    )
    return profile.peak()


def main() -> None:
    config_path, result_path = sys.argv[1:3]
    raw = json.loads(Path(config_path).read_text())
    raw["batch"] = tuple(raw["batch"])
    cfg = RigConfig(**raw)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    install_filling_collectives()
    if cfg.impl == "estimate":
        result: dict[str, Any] = {"estimate_bytes": estimate(cfg)}
    else:
        result = asdict(run(cfg))
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import fsdp_legacy from the checkout
    main()
