"""transformers' Trainer with its FSDP1 settings (`fsdp` / `fsdp_config` with version 1, built through Accelerate), and
PEFT LoRA trained by the same Trainer, on 2 CPU ranks: train 3 steps, save a checkpoint, a new Trainer resumes from it
to step 5 (not LoRA: see train_run), for each configuration; see common.py for the contract with test_frameworks.py.

On CPU the Trainer's Accelerator silently uses DDP (Accelerate enables its FSDP plugin only for GPU-like backends): a
Trainer subclass (common.hf_trainer_on_cpu) sets the accelerator's state to FSDP as Accelerate's FSDP branch would,
exactly as run_accelerate.py does, and tells the Trainer (`is_fsdp_enabled`), which then wraps, clips, saves and loads
through FSDP as on a GPU. Accelerate passes device_id=cpu itself, which torch's FSDP1 needs on CPU.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from common import (
    check_impl,
    checksum,
    compiled_graphs,
    full_params,
    hf_fsdp_arguments,
    hf_trainer_on_cpu,
    parse_args,
    run_all,
)


@dataclass(frozen=True)
class Run:
    name: str
    state_dict_type: str  # FULL_STATE_DICT | SHARDED_STATE_DICT
    use_orig_params: bool
    bf16: bool = False  # TrainingArguments(bf16=True): Accelerate's mixed_precision="bf16"
    lora: bool = False
    torch_compile: bool = False  # TrainingArguments(torch_compile=True): the wrapped model under torch.compile


RUNS = [
    Run("trainer_fp32_full", "FULL_STATE_DICT", use_orig_params=False),
    Run("trainer_bf16_sharded_uop", "SHARDED_STATE_DICT", use_orig_params=True, bf16=True),
    Run("lora_full_uop", "FULL_STATE_DICT", use_orig_params=True, lora=True),
    Run("trainer_compiled_sharded_uop", "SHARDED_STATE_DICT", use_orig_params=True, torch_compile=True),
]
VOCAB, LENGTH = 64, 16


def model(run: Run, seed: int):  # type: ignore[no-untyped-def]
    """The tiny Llama; with LoRA, the base weights are always the same ("pretrained") and the adapters take `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0 if run.lora else seed)
    net = LlamaForCausalLM(config)
    if not run.lora:
        return net
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(
        net, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )


def dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (64, LENGTH), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def trainer(run: Run, net: Any, directory: str, steps: int):  # type: ignore[no-untyped-def]
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=directory,
        **hf_fsdp_arguments(run.use_orig_params, run.state_dict_type),
        bf16=run.bf16,
        torch_compile=run.torch_compile,
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=3,
        logging_steps=1,
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    return hf_trainer_on_cpu(Trainer)(model=net, args=args, train_dataset=dataset())


def fsdp_model(trainer: Any) -> Any:
    """The FSDP-wrapped model a Trainer trains. With torch_compile the Trainer's model is torch.compile's module around
    the bare model, and the FSDP module that Accelerate built is in the accelerator's list."""
    return trainer.accelerator._models[0] if trainer.args.torch_compile else trainer.model_wrapped


def train_run(run: Run, impl: str, directory: str) -> dict:
    if dist.get_rank() == 0 and os.path.exists(directory):
        shutil.rmtree(directory)
    dist.barrier()
    first_model = model(run, seed=0)
    initial = {name: p.detach().float().clone() for name, p in first_model.named_parameters()}
    trainable = sorted(name for name, p in first_model.named_parameters() if p.requires_grad)
    first = trainer(run, first_model, directory, steps=3)
    first.train()  # saves checkpoint-3
    history = [entry for entry in first.state.log_history if "loss" in entry]
    wrapped = fsdp_model(first)
    result = dict(
        config=asdict(run),
        fsdp=check_impl(impl, wrapped),
        losses=[float(entry["loss"]) for entry in history],
        grad_norms=[float(entry["grad_norm"]) for entry in history],
        param_dtypes=sorted({str(p.dtype) for p in wrapped.parameters()}),
        compute_dtype=str(wrapped.mixed_precision.param_dtype),  # bf16: Accelerate's MixedPrecision
        compiled=compiled_graphs() > 0,
    )
    trained = full_params(wrapped)
    dist.barrier()
    if run.lora:
        # No resuming: PEFT 0.21.2 finds a model's adapter weights by module names with only the root's
        # `_fsdp_wrapped_module.` removed, so under FSDP1's nested units (decoder layers, LoRA layers) it selects none,
        # on torch's FSDP1 as on ours: the checkpoint's adapter files (pytorch_model_fsdp.bin and
        # adapter_model.safetensors) hold no tensor, and a resumed run would silently go on with fresh adapters.
        assert trained.keys() == initial.keys(), sorted(trained.keys() ^ initial.keys())
        change = {name: (trained[name] - initial[name]).abs().max().item() for name in initial}
        return result | dict(
            lora_params=trainable,
            frozen_max_change=max(v for k, v in change.items() if k not in trainable),
            lora_min_change=min(change[k] for k in trainable),
            params_after_training=checksum(trained),
        )
    if run.torch_compile:
        # No resuming: transformers 5.23's Trainer cannot resume a compiled FSDP1 model, on torch's FSDP1 as on ours
        # (SHARDED: "Size mismatch between saved torch.Size([1024]) and current: torch.Size([0]) for
        # model._orig_mod.lm_head.weight"; FULL asks for sync_module_states, which needs a GPU). Training and the
        # saved checkpoint are compared.
        return result
    second = trainer(run, model(run, seed=1), directory, steps=5)  # other weights: all must come from the checkpoint
    second.train(resume_from_checkpoint=os.path.join(directory, "checkpoint-3"))
    check_impl(impl, fsdp_model(second))
    resumed = [entry for entry in second.state.log_history if "loss" in entry and entry["step"] > 3]
    result |= dict(
        step=second.state.global_step,
        losses_after_resume=[float(entry["loss"]) for entry in resumed],
        params_after_resume=checksum(full_params(fsdp_model(second))),
    )
    dist.barrier()
    if run.state_dict_type == "SHARDED_STATE_DICT":  # the oracle of the resume: the same 5 steps without a break
        whole = trainer(run, model(run, seed=0), f"{directory}-uninterrupted", steps=5)
        whole.train()
        after = [entry for entry in whole.state.log_history if "loss" in entry and entry["step"] > 3]
        result |= dict(
            uninterrupted_losses=[float(entry["loss"]) for entry in after],
            params_uninterrupted=checksum(full_params(fsdp_model(whole))),
        )
        dist.barrier()
    return result


def main() -> None:
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"  # otherwise Accelerate passes device_id=cpu:0, which FSDP1 refuses
    args = parse_args()
    dist.init_process_group("gloo")  # the Trainer's PartialState takes it over
    run_all(args, RUNS, train_run)


if __name__ == "__main__":
    main()
