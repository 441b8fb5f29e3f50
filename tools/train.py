"""Demo: train a small GPT on a synthetic corpus with fsdp_legacy, then sample from it.

    python tools/train.py                          # launches 2 local ranks by itself
    torchrun --nproc-per-node=2 tools/train.py     # same thing, launched by torchrun

gloo on CPU (nccl when CUDA is available). ``--impl torch`` runs the same script on
torch's own FSDP1 for comparison. ``--mixed-precision bf16`` computes in bfloat16 on
float32 sharded parameters and reduces gradients in float32. ``--activation-checkpointing``
recomputes each block's activations in backward instead of keeping them.

At the end (fsdp_legacy only, unless ``--migrate-steps 0``) the demo migrates to FSDP2: it saves a
LOCAL_STATE_DICT checkpoint (flat shards and Adam state), converts it offline with
fsdp_legacy.convert into FSDP2's layout, loads that into a fresh ``fully_shard`` model with torch's
own helpers, and trains both models on the same batches: the losses agree.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # import fsdp_legacy from the checkout
from gpt import GPT, Block, CharTokenizer, GPTConfig, batches, generate, make_corpus
from process_exit import exit_now

PROMPTS = ["the ", "count 3", "2 plus 2 is", "4 plus 3 is"]

# --mixed-precision: MixedPrecision arguments (None: no mixed precision).
MIXED_PRECISION: dict[str, dict[str, torch.dtype] | None] = {
    "none": None,
    "bf16": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16),
    "fp16": dict(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--sharding-strategy",
        type=str.upper,
        default="FULL_SHARD",
        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"],
    )
    p.add_argument(
        "--mixed-precision",
        choices=list(MIXED_PRECISION),
        default="none",
        help="bf16: parameters and buffers in bfloat16 for compute, gradients reduced in float32; "
        "the sharded parameters, gradients and optimizer state stay float32. "
        "fp16: compute and gradient reduction in float16, without a gradient scaler; this demo "
        "trains like float32 with it (the loss is computed in float32), but float16 runs several "
        "times slower on CPUs without native float16 matmul",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each transformer block's activations in backward (less memory, more compute)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", choices=["ours", "torch"], default="ours", help="fsdp_legacy or torch's FSDP1")
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch when not started by torchrun")
    p.add_argument(
        "--migrate-steps",
        type=int,
        default=5,
        help="after training, migrate to FSDP2 through a converted checkpoint and continue this many steps "
        "side by side (0: skip)",
    )
    p.add_argument("--checkpoint-dir", default="checkpoints/demo", help="where the migration writes its checkpoints")
    args = p.parse_args()
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def load_fsdp(impl: str) -> tuple[Any, Any, Any, Any]:
    """(FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy, MixedPrecision) of ``impl``.

    Both packages expose the same names: ours is a drop-in replacement for torch's FSDP1.
    """
    fsdp = importlib.import_module("fsdp_legacy" if impl == "ours" else "torch.distributed.fsdp")
    wrap = importlib.import_module(f"{fsdp.__name__}.wrap")
    return fsdp.FullyShardedDataParallel, wrap.ModuleWrapPolicy, fsdp.ShardingStrategy, fsdp.MixedPrecision


def init_distributed() -> torch.device:
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        dist.init_process_group("nccl")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    # The local ranks share the cores: oversubscribing threads slows everyone down.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    return torch.device("cpu")


def train(args: argparse.Namespace) -> None:
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    FSDP, ModuleWrapPolicy, ShardingStrategy, MixedPrecision = load_fsdp(args.impl)

    text = make_corpus(seed=args.seed)
    tok = CharTokenizer(text)
    data = torch.tensor(tok.encode(text))
    cfg = GPTConfig(
        vocab_size=tok.vocab_size,
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=max(1, args.d_model // 32),
        d_model=args.d_model,
    )
    torch.manual_seed(args.seed)  # identical init on every rank, so no broadcast is needed
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    dtypes = MIXED_PRECISION[args.mixed_precision]
    model = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy[args.sharding_strategy],
        mixed_precision=MixedPrecision(**dtypes) if dtypes else None,
        device_id=device,
    )
    if args.activation_checkpointing:
        # After wrapping: the checkpoint wrapper goes inside each block's FSDP unit.
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Short linear warm-up: a full-size first Adam step makes the loss spike.
    warmup = max(1, min(20, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))

    if rank == 0:
        print(
            f"impl={args.impl} world={world} backend={dist.get_backend()} {args.sharding_strategy} "
            f"mixed_precision={args.mixed_precision} activation_checkpointing={args.activation_checkpointing} "
            f"params={n_params / 1e6:.2f}M vocab={tok.vocab_size} corpus={len(text):,} chars",
            flush=True,
        )

    tokens_per_step = args.batch_size * args.seq_len * world
    data_iter = batches(data, args.batch_size, args.seq_len, rank, args.seed)
    losses: list[float] = []
    bar = tqdm(range(args.steps), disable=rank != 0, desc="train", dynamic_ncols=True)
    start = last = time.perf_counter()
    for _ in bar:
        x, y = (t.to(device) for t in next(data_iter))
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        # Log the mean over ranks: each rank sees different data.
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        now = time.perf_counter()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step / (now - last):,.0f}")
        last = now
    elapsed = time.perf_counter() - start

    # Sampling: every rank runs the same number of forwards, since each one all-gathers.
    model.eval()
    samples = []
    g = torch.Generator(device=device).manual_seed(args.seed)
    for prompt in PROMPTS:
        idx = torch.tensor([tok.encode("\n" + prompt)], device=device)
        out = generate(model, idx, max_new_tokens=30, block_size=cfg.block_size, temperature=0.5, generator=g)
        completion = tok.decode(out[0, idx.shape[1] :].tolist())
        samples.append(prompt + completion.split("\n")[0])

    if rank == 0:
        tail = losses[-10:]
        print(
            f"done: {args.steps} steps in {elapsed:.1f}s "
            f"({tokens_per_step * args.steps / elapsed:,.0f} tok/s), "
            f"loss first {losses[0]:.3f} -> last {losses[-1]:.3f} "
            f"(mean of last {len(tail)}: {sum(tail) / len(tail):.3f})"
        )
        print("samples:")
        for s in samples:
            print(f"  {s!r}")
    if args.impl == "ours" and args.migrate_steps > 0:
        model.train()
        migrate_to_fsdp2(args, model, opt, lambda: GPT(cfg), data_iter, device, dtypes)
    # Every rank done with every collective before any tears its process group down, then out without the teardown.
    dist.barrier()
    dist.destroy_process_group()
    exit_now()


def migrate_to_fsdp2(
    args: argparse.Namespace,
    model: Any,
    opt: torch.optim.Optimizer,
    build: Any,
    data_iter: Any,
    device: torch.device,
    dtypes: dict[str, torch.dtype] | None,
) -> None:
    """Checkpoint -> offline conversion -> FSDP2, then both models continue on the same batches."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_legacy import FullyShardedDataParallel as FSDP
    from fsdp_legacy import StateDictType
    from fsdp_legacy.convert import convert_checkpoint
    from fsdp_legacy.state import dcp_checkpoint

    rank = dist.get_rank()
    local_dir = os.path.join(args.checkpoint_dir, "local")
    fsdp2_dir = os.path.join(args.checkpoint_dir, "fsdp2")
    if rank == 0:
        shutil.rmtree(local_dir, ignore_errors=True)
    dist.barrier()
    # 1. What an FSDP1 job saves: each rank's flat shards and its optimizer state (the layout records in a side file).
    with warnings.catch_warnings():  # torch FSDP1's FutureWarning about state_dict_type, kept for parity
        warnings.simplefilter("ignore", FutureWarning)
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
    dcp_checkpoint.save(state, local_dir)  # dcp.save + the side file with the layout records the converter reads
    del state
    # 2. Offline, on one process, without the model's code: flat shards -> FSDP2's per-parameter layout.
    if rank == 0:
        report = convert_checkpoint(local_dir, fsdp2_dir, to="dcp")
        print(f"migration: saved {local_dir} (LOCAL_STATE_DICT); converted: {report.summary()}", flush=True)
    dist.barrier()
    # 3. FSDP2 loads it with torch's own helpers into a model initialised differently (all comes from the file).
    torch.manual_seed(args.seed + 1)
    model2 = build().to(device)
    mp_policy = (
        MixedPrecisionPolicy(dtypes["param_dtype"], dtypes["reduce_dtype"]) if dtypes else MixedPrecisionPolicy()
    )
    for block in model2.blocks:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model2, mp_policy=mp_policy)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=args.lr)
    state = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(state, checkpoint_id=fsdp2_dir)
    set_model_state_dict(model2, state["model"])
    set_optimizer_state_dict(model2, opt2, state["optim"])
    # 4. Both continue on the same batches (the learning rate is the one saved with the optimizer state).
    for step in range(args.migrate_steps):
        x, y = (t.to(device) for t in next(data_iter))
        losses = []
        for m, o in ((model, opt), (model2, opt2)):
            _, loss = m(x, y)
            o.zero_grad(set_to_none=True)
            loss.backward()
            o.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
        if rank == 0:
            print(
                f"  continued step {step + 1}: fsdp_legacy loss {losses[0]:.5f}, FSDP2 loss {losses[1]:.5f}", flush=True
            )


def launch_local(nproc: int) -> None:
    """Re-run this script under torchrun with ``nproc`` local ranks (single-line README command)."""
    from torch.distributed.run import main as torchrun

    # Set before torchrun does, which would otherwise warn and force 1 thread.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // nproc)))
    torchrun(["--standalone", f"--nproc-per-node={nproc}", __file__, *sys.argv[1:]])


if __name__ == "__main__":
    cli_args = parse_args()
    if "LOCAL_RANK" in os.environ:
        train(cli_args)
    else:
        launch_local(cli_args.nproc)
