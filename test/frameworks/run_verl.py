"""verl's FSDP1 engine (`verl.workers.engine.fsdp.FSDPEngineWithLMHead`, what verl's actor and critic workers build)
on 2 CPU ranks, with verl's own code for every stage: set-up (`initialize`: a tiny Llama loaded by path, meta weights
on rank 1 materialised by verl's `init_fn` and broadcast by `sync_module_states`, verl's wrap policy, verl's
MixedPrecision, optimizer, scheduler and FSDPCheckpointManager), PPO updates (`train_batch` with verl's `ppo_loss`
on batches made by verl's `left_right_2_no_padding`, clipped by the engine's `clip_grad_norm_`), log-probabilities in
eval mode (`infer_batch`), parameter and optimizer offload and reload between steps (verl/utils/fsdp_utils.py),
checkpoint save, load into a new engine and resume (`save_checkpoint` / `load_checkpoint`), weight sync to a rollout
engine (`get_per_tensor_param`, `get_per_tensor_param_shard`) and, with LoRA (verl's PEFT model and its lambda wrap
policy), the three LoRA export paths of `get_per_tensor_param`: the layered summon, the full summon (adapters, or the
base weights before the base model is synced) and the merged weights. See common.py for the launch contract;
test_verl.py compares the runs.

Each rank writes DIR/<run>/rank<r>.pt (every tensor a stage produced, by stage) and rank 0 DIR/results.json (what is not
a tensor). verl 0.9.1 assumes an accelerator; `verl_on_cpu` gives it the CPU, the same for both implementations, and
works around two of torch's FSDP1's CPU failures for the oracle run.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from common import check_impl, fsdp_class, full_params, parse_args, run_all
from run_trl import save_model_and_tokenizer


@dataclass(frozen=True)
class Run:
    name: str
    use_orig_params: bool
    param_dtype: str  # verl's mixed_precision.param_dtype (fp32: no casting; bf16: verl's default)
    lora: bool = False  # model_config.lora_rank > 0: verl makes the PEFT model and wraps each adapter leaf
    fsdp_size: int = 2  # 2: FULL_SHARD over both ranks; 1: verl's 2-D ("ddp", "fsdp") mesh, HYBRID_SHARD


RUNS = [
    Run("fp32", use_orig_params=False, param_dtype="fp32"),
    Run("fp32_uop", use_orig_params=True, param_dtype="fp32"),
    Run("bf16", use_orig_params=False, param_dtype="bf16"),
    Run("bf16_uop", use_orig_params=True, param_dtype="bf16"),
    Run("lora", use_orig_params=False, param_dtype="fp32", lora=True),
    Run("lora_bf16_uop", use_orig_params=True, param_dtype="bf16", lora=True),
    Run("hsdp", use_orig_params=False, param_dtype="fp32", fsdp_size=1),
]
STEPS, SAVED_AT, BATCH, PROMPT, RESPONSE = 5, 3, 4, 4, 4
LORA_RANK, LORA_ALPHA, CLIP = 4, 8, 0.03


def verl_on_cpu(impl: str) -> None:
    """verl 0.9.1 knows CUDA, NPU and ROCm platforms only, and falls back to CUDA: a CPU platform instead (device
    "cpu", gloo). TRL being installed makes verl patch a TRL class that TRL 1.16 no longer has: verl is told it is
    not. torch.cpu gets the no-op `empty_cache` verl calls after each move.

    For torch's FSDP1 only (ours needs neither): it refuses `sync_module_states=True` (verl's setting) with CPU
    parameters although gloo broadcasts them, so that check is skipped; and verl's LoRA exports read the summoned
    parameters as `param.detach().cpu()` and use them after the summon, a copy from an accelerator but on CPU the
    summoned storage itself, which torch's frees on leaving (reading it then segfaults), so `Tensor.cpu` copies a CPU
    tensor, as it copies a device's. Ours returns copies there."""
    import verl.models.transformers.monkey_patch as monkey_patch
    import verl.utils.checkpoint.checkpoint_manager as checkpoint_manager
    import verl.utils.fsdp_utils as fsdp_utils
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class PlatformCPU(PlatformCUDA):  # type: ignore[misc]
        device_name = "cpu"  # type: ignore[assignment]
        device_module = torch.cpu  # type: ignore[assignment]  (verl's memory logging knows it)

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return torch.device("cpu")

        def communication_backend_name(self) -> str:
            return "gloo"

    platform_manager.set_platform(PlatformCPU())
    if not hasattr(torch.cpu, "empty_cache"):  # verl calls it after each move
        torch.cpu.empty_cache = lambda: None  # type: ignore[attr-defined]
    monkey_patch.is_trl_available = lambda: False
    fsdp_utils.get_device_id = lambda: 0  # see materialising()
    checkpoint_manager.is_device_available = lambda: False  # else it restores torch.cpu's RNG under the key "cpu"
    if impl == "torch":
        host = torch.Tensor.cpu

        def device_to_host(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return self.clone() if self.device.type == "cpu" else host(self, *args, **kwargs)

        torch.Tensor.cpu = device_to_host  # type: ignore[method-assign]
        from torch.distributed.fsdp import _init_utils

        _init_utils._check_module_states_for_sync_module_states = lambda states: None


@contextlib.contextmanager
def materialising() -> Iterator[None]:
    """verl's `load_fsdp_model_to_gpu` moves to f"{device_name}:{device_id}", an accelerator's index: 0 ("cpu:0")
    is what verl_on_cpu gives it. verl's `init_fn` (rank 1's meta weights, `to_empty(device=device_id)`) must get the
    CPU device itself, which the index 0 would make CUDA's."""
    import verl.utils.fsdp_utils as fsdp_utils

    index = fsdp_utils.get_device_id
    fsdp_utils.get_device_id = lambda: torch.device("cpu")
    try:
        yield
    finally:
        fsdp_utils.get_device_id = index


def build_engine(run: Run, model_path: str, forward_only: bool = False) -> Any:
    """verl's engine from verl's configs; `forward_only` is verl's reference policy (CPUOffload(offload_params=True),
    no optimizer)."""
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model = HFModelConfig(
        path=model_path,
        use_remove_padding=False,  # packed sequences need flash attention
        override_config={"attn_implementation": "eager"},
        lora_rank=LORA_RANK if run.lora else 0,
        lora_alpha=LORA_ALPHA,
    )
    engine = FSDPEngineWithLMHead(
        model,
        FSDPEngineConfig(
            strategy="fsdp",
            forward_only=forward_only,
            use_orig_params=run.use_orig_params,
            use_torch_compile=False,
            fsdp_size=run.fsdp_size,  # > 1: eval mode reshards the root's handle on exit (`_handle.reshard(True)`)
            mixed_precision={"param_dtype": run.param_dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        ),
        FSDPOptimizerConfig(lr=1e-2, clip_grad=CLIP),  # below the full models' gradient norms: their steps clip
        CheckpointConfig(),
    )
    with materialising():
        engine.initialize()
    return engine


def ppo_batch(step: int, train: bool) -> Any:
    """A rollout batch as verl's trainer hands it to the actor: left-padded prompts, right-padded responses, old
    log-probabilities and advantages, turned into verl's no-padding layout; different on every rank and step."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
    prompts = torch.randint(4, 44, (BATCH, PROMPT), generator=generator)
    responses = torch.randint(4, 44, (BATCH, RESPONSE), generator=generator)
    prompt_mask, response_mask = torch.ones_like(prompts), torch.ones_like(responses)
    prompt_mask[0, :2] = prompt_mask[1, :1] = 0
    response_mask[2, 3:] = response_mask[3, 2:] = 0
    prompts[prompt_mask == 0], responses[response_mask == 0] = 0, 0
    attention = torch.cat([prompt_mask, response_mask], 1)
    data = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
            "response_mask": response_mask,
            "old_log_probs": -3 * torch.rand(BATCH, RESPONSE, generator=generator),
            "advantages": torch.randn(BATCH, RESPONSE, generator=generator),
        },
        batch_size=[BATCH],
    )
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(
        data,
        temperature=1.0,
        calculate_entropy=True,
        compute_loss=train,
        global_batch_size=BATCH * dist.get_world_size(),
        use_remove_padding=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,  # two micro-batches: the engine's no_sync on the first
        max_token_len_per_gpu=None,
        use_fused_kernels=False,
    )
    return data


def loss_function() -> Any:
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    actor = ActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=BATCH * dist.get_world_size(),
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
        entropy_coeff=0.01,
        rollout_n=1,
    )
    return partial(ppo_loss, config=actor)


def as_tensor(value: Any) -> torch.Tensor:
    """A figure verl returns (a Metric, a list of them, a float, a tensor) as a float64 tensor, every value exact."""
    if hasattr(value, "values") and not isinstance(value, (dict, torch.Tensor)):  # verl's Metric
        value = value.values
    if isinstance(value, (list, tuple)):
        return torch.cat([as_tensor(item).reshape(-1) for item in value]) if value else torch.zeros(0)
    if isinstance(value, torch.Tensor):
        return value.detach().double().reshape(-1)
    return torch.tensor([float(value)], dtype=torch.float64)


def ppo_step(engine: Any, step: int, found: dict[str, torch.Tensor], prefix: str) -> None:
    """One PPO update as verl's actor worker makes it (train mode, `train_batch`, the scheduler step)."""
    with engine.train_mode():
        output = engine.train_batch(ppo_batch(step, train=True), loss_function=loss_function())
    engine.lr_scheduler_step()
    for key, value in output["metrics"].items():
        found[f"{prefix}/step{step}/{key}"] = as_tensor(value)


def local_shards(engine: Any) -> dict[str, torch.Tensor]:
    """Each unit's flat parameter (its local shard between steps), in the units' order."""
    units = fsdp_class().fsdp_modules(engine.module)
    return {f"unit{i}": unit._handle.flat_param.detach().clone() for i, unit in enumerate(units) if unit._handle}


def offload_and_reload(engine: Any, found: dict[str, torch.Tensor], step: int) -> None:
    """verl's offload between steps (what the engine's `to("cpu")` and `to(device)` call on an accelerator): the
    parameters' shards and the optimizer's state out and back."""
    from verl.utils import fsdp_utils

    before = local_shards(engine)
    fsdp_utils.offload_fsdp_model_to_cpu(engine.module)
    fsdp_utils.offload_fsdp_optimizer(engine.optimizer)
    fsdp_utils.load_fsdp_model_to_gpu(engine.module)
    fsdp_utils.load_fsdp_optimizer(engine.optimizer, "cpu")
    after = local_shards(engine)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), "moved shards"
    for unit, shard in after.items():
        found[f"reloaded/step{step}/{unit}"] = shard


def log_probs(engine: Any, found: dict[str, torch.Tensor], prefix: str) -> None:
    """verl's compute_log_prob: the engine in eval mode, `infer_batch`, log-probabilities and entropies."""
    with engine.eval_mode():
        output = engine.infer_batch(ppo_batch(0, train=False))
    for key in ("log_probs", "entropy"):
        found[f"{prefix}/{key}"] = output["model_output"][key].values().detach().clone()


def exported(prefix: str, params: Any, found: dict[str, torch.Tensor]) -> list[str]:
    """What a weight sync would send to the rollout engine, by name (DTensors as their local part)."""
    names = []
    for item in params:
        name, value = item[0], item[1]
        names.append(name)
        value = value.to_local() if hasattr(value, "to_local") else value
        found[f"{prefix}/{name}"] = value.detach().clone()
    return names


def weight_sync(engine: Any, run: Run, found: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """verl's rollout weight sync from the engine: full tensors, the local shards, and with LoRA the three export
    paths (the layered summon and the full summon of the adapters, the base weights before the base model is in the
    rollout engine, and the adapters merged into the base weights)."""
    names = {}
    if not run.lora:
        params, _ = engine.get_per_tensor_param()
        names["sync"] = exported("sync", params, found)
        shards, _ = engine.get_per_tensor_param_shard()
        names["sync_shard"] = exported("sync_shard", shards, found)
        return names
    for name, layered, base_sync_done in (
        ("lora_layered", True, True),
        ("lora_full", False, True),
        ("lora_base", False, False),
    ):
        params, peft_config = engine.get_per_tensor_param(layered_summon=layered, base_sync_done=base_sync_done)
        assert peft_config is not None or not base_sync_done
        names[name] = exported(name, params, found)
    engine.model_config.lora["merge"] = True
    try:
        params, _ = engine.get_per_tensor_param()
        names["lora_merged"] = exported("lora_merged", params, found)
    finally:
        engine.model_config.lora["merge"] = False
    return names


def train_run(run: Run, impl: str, directory: str) -> dict:
    out = Path(directory)
    model_path, checkpoint = str(out / "model"), str(out / "checkpoints" / f"global_step_{SAVED_AT}")
    if dist.get_rank() == 0:
        save_model_and_tokenizer(model_path)
    dist.barrier()
    found: dict[str, torch.Tensor] = {}
    torch.manual_seed(0)  # LoRA's adapters are initialised on rank 0, then broadcast
    random.seed(0), np.random.seed(0)  # verl's checkpoints hold these RNGs' states too
    engine = build_engine(run, model_path)
    result: dict[str, Any] = {"config": asdict(run), "fsdp": check_impl(impl, engine.module), "clip": CLIP}
    result["lora_scaling"] = LORA_ALPHA / LORA_RANK
    fsdp = fsdp_class()
    result["units"] = [name for name, m in engine.module.named_modules() if isinstance(m, fsdp)]
    result["param_dtypes"] = sorted({str(p.dtype) for p in engine.module.parameters()})
    found |= {f"setup/shard/{k}": v for k, v in local_shards(engine).items()}
    found |= {f"setup/full/{k}": v for k, v in full_params(engine.module).items()}
    result["reference_offloads"] = None
    if not run.lora and impl == "ours":  # verl's reference policy of the same weights (with LoRA: the actor without
        # its adapters). torch's FSDP1 cannot offload parameters with a CPU compute device (it pins them: "Cannot
        # access accelerator device"), so there the actor's log-probabilities before training are the oracle.
        reference = build_engine(run, model_path, forward_only=True)
        result["reference_offloads"] = [unit.cpu_offload.offload_params for unit in fsdp.fsdp_modules(reference.module)]
        log_probs(reference, found, "reference")
        del reference
    for step in range(SAVED_AT):
        log_probs(engine, found, f"infer/step{step}")
        ppo_step(engine, step, found, "train")
        offload_and_reload(engine, found, step)
    found |= {f"saved/full/{k}": v for k, v in full_params(engine.module).items()}
    engine.save_checkpoint(checkpoint, global_step=SAVED_AT)
    result["exported"] = weight_sync(engine, run, found)
    for step in range(SAVED_AT, STEPS):  # after the exports: they must have left the model as it was
        ppo_step(engine, step, found, "train")
    found |= {f"final/full/{k}": v for k, v in full_params(engine.module).items()}

    torch.manual_seed(1)  # the resumed engine starts elsewhere; the checkpoint restores it
    resumed = build_engine(run, model_path)
    resumed.load_checkpoint(checkpoint, del_local_after_load=False)
    found |= {f"loaded/shard/{k}": v for k, v in local_shards(resumed).items()}
    for step in range(SAVED_AT, STEPS):
        ppo_step(resumed, step, found, "resumed")
    found |= {f"resumed/full/{k}": v for k, v in full_params(resumed.module).items()}
    torch.save(found, out / f"rank{dist.get_rank()}.pt")
    result["checkpoint_files"] = sorted(os.listdir(checkpoint))
    return result


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    verl_on_cpu(args.impl)
    run_all(args, RUNS, train_run)


if __name__ == "__main__":
    main()
