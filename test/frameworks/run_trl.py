"""TRL's trainers with transformers' FSDP1 settings (built through Accelerate) on 2 CPU ranks: SFT (train, save, resume;
PEFT LoRA; gradient accumulation), DPO with a reference model that TRL wraps itself (`trl.models.prepare_fsdp`:
FullyShardedDataParallel(...) with the plugin's arguments), and GRPO, which samples completions from the training model
inside `FSDP.summon_full_params(model, recurse=False)` and scores them against a wrapped reference model. See common.py
for the contract with test_frameworks.py.

The model is a tiny Llama saved to disk with a word-level tokenizer, and passed by path, as TRL's users pass a model id;
TRL loads the reference models from the same path. On CPU the trainers' Accelerator silently uses DDP, so the trainer
subclasses set its state to FSDP as run_transformers.py does. TRL's defaults otherwise, gradient checkpointing (inside
each decoder layer, so inside each unit) included.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from common import check_impl, checksum, full_params, hf_fsdp_arguments, hf_trainer_on_cpu, parse_args, run_all


@dataclass(frozen=True)
class Run:
    name: str
    trainer: str  # sft | dpo | grpo
    use_orig_params: bool
    state_dict_type: str = "FULL_STATE_DICT"
    bf16: bool = False
    lora: bool = False  # peft_config: TRL makes the PEFT model itself
    accumulation: int = 1  # gradient_accumulation_steps (Accelerate's no_sync between them)


RUNS = [
    Run("sft_full", "sft", use_orig_params=False),
    Run("sft_bf16_sharded_uop", "sft", use_orig_params=True, state_dict_type="SHARDED_STATE_DICT", bf16=True),
    Run("sft_lora_uop", "sft", use_orig_params=True, lora=True),
    Run("sft_accumulating", "sft", use_orig_params=False, accumulation=2),
    Run("dpo_ref_model", "dpo", use_orig_params=False),
    Run("dpo_ref_model_uop", "dpo", use_orig_params=True, state_dict_type="SHARDED_STATE_DICT"),
    Run("grpo_generate_in_summon", "grpo", use_orig_params=False),
    Run("grpo_generate_in_summon_uop", "grpo", use_orig_params=True),
]
WORDS = [f"w{i}" for i in range(40)]
STEPS = 3


def save_model_and_tokenizer(directory: str) -> None:
    """A tiny Llama and a word-level tokenizer of WORDS, as from_pretrained reads them (rank 0 writes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def sentences(count: int, length: int, seed: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(WORDS), (count, length), generator=generator)
    return [" ".join(WORDS[i] for i in row) for row in picks.tolist()]


def dataset(run: Run) -> Any:
    from datasets import Dataset

    if run.trainer == "sft":
        return Dataset.from_dict({"text": sentences(32, 12, seed=1)})
    if run.trainer == "dpo":
        return Dataset.from_dict(
            {
                "prompt": sentences(32, 4, seed=2),
                "chosen": sentences(32, 6, seed=3),
                "rejected": sentences(32, 6, seed=4),
            }
        )
    return Dataset.from_dict({"prompt": sentences(32, 4, seed=5)})


def reward_w0(completions: list[str], **_: Any) -> list[float]:
    """GRPO's reward: how often the completion says w0 (anything deterministic in the sampled text will do)."""
    return [float(text.split().count("w0")) for text in completions]


def trainer(run: Run, model_path: str, directory: str, steps: int) -> Any:
    import trl
    from transformers import AutoTokenizer

    config_class, trainer_class = {
        "sft": (trl.SFTConfig, trl.SFTTrainer),
        "dpo": (trl.DPOConfig, trl.DPOTrainer),
        "grpo": (trl.GRPOConfig, trl.GRPOTrainer),
    }[run.trainer]
    specific: dict[str, Any] = {
        "sft": dict(max_length=16),
        "dpo": dict(max_length=16, beta=0.1),
        "grpo": dict(num_generations=2, max_completion_length=6, beta=0.1, temperature=1.0, log_completions=False),
    }[run.trainer]
    args = config_class(
        output_dir=directory,
        **hf_fsdp_arguments(run.use_orig_params, run.state_dict_type),
        bf16=run.bf16,
        max_steps=steps,
        gradient_accumulation_steps=run.accumulation,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=STEPS,
        logging_steps=1,
        report_to=[],
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        **specific,
    )
    extra: dict[str, Any] = {"reward_funcs": reward_w0} if run.trainer == "grpo" else {}
    if run.lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return hf_trainer_on_cpu(trainer_class)(
        model=model_path,
        args=args,
        train_dataset=dataset(run),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        **extra,
    )


def figures(history: list[dict]) -> dict[str, list[float]]:
    """Every numeric figure TRL logged at each step (loss, grad_norm, rewards, margins, log-probabilities, KL, ...),
    by name; timings and the learning rate left out."""
    logged = [entry for entry in history if "loss" in entry]
    names = sorted(
        key
        for key, value in logged[0].items()
        if isinstance(value, (int, float)) and key not in ("epoch", "step", "learning_rate") and "time" not in key
    )
    return {f"logged_{name}": [float(entry[name]) for entry in logged] for name in names}


def train_run(run: Run, impl: str, directory: str) -> dict:
    model_path = os.path.join(directory, "pretrained")
    if dist.get_rank() == 0:
        if os.path.exists(directory):
            shutil.rmtree(directory)
        save_model_and_tokenizer(model_path)
    dist.barrier()
    first = trainer(run, model_path, directory, steps=STEPS)
    first.train()  # saves checkpoint-3
    wrapped = first.model_wrapped
    result: dict[str, Any] = dict(
        config=asdict(run),
        fsdp=check_impl(impl, wrapped),
        # TRL's default: transformers' checkpointing inside each decoder layer, that is inside each FSDP unit
        gradient_checkpointing=first.args.gradient_checkpointing and wrapped.module.is_activation_checkpointing,
    )
    if run.trainer != "sft":  # the reference model TRL wrapped with FullyShardedDataParallel(...) itself
        result["ref_fsdp"] = check_impl(impl, first.ref_model)
        result["params_ref_model"] = checksum(full_params(first.ref_model))
    result |= figures(first.state.log_history)
    result["params_after_training"] = checksum(full_params(wrapped))
    dist.barrier()
    if run.trainer == "sft" and not run.lora:  # (LoRA under FSDP1 saves no adapter: see run_transformers.py)
        second = trainer(run, model_path, directory, steps=STEPS + 2)
        second.train(resume_from_checkpoint=os.path.join(directory, "checkpoint-3"))
        check_impl(impl, second.model_wrapped)
        resumed = [entry for entry in second.state.log_history if "loss" in entry and entry["step"] > STEPS]
        result |= dict(
            step=second.state.global_step,
            losses_after_resume=[float(entry["loss"]) for entry in resumed],
            params_after_resume=checksum(full_params(second.model_wrapped)),
        )
        dist.barrier()
        if run.state_dict_type == "SHARDED_STATE_DICT":  # the oracle of the resume: the same steps without a break
            whole = trainer(run, model_path, f"{directory}-uninterrupted", steps=STEPS + 2)
            whole.train()
            after = [entry for entry in whole.state.log_history if "loss" in entry and entry["step"] > STEPS]
            result |= dict(
                uninterrupted_losses=[float(entry["loss"]) for entry in after],
                params_uninterrupted=checksum(full_params(whole.model_wrapped)),
            )
            dist.barrier()
    return result


def main() -> None:
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"  # otherwise Accelerate passes device_id=cpu:0, which FSDP1 refuses
    args = parse_args()
    dist.init_process_group("gloo")
    run_all(args, RUNS, train_run)


if __name__ == "__main__":
    main()
