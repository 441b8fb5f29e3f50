"""`fsdp-legacy convert`: a checkpoint converted offline (fsdp_legacy.convert.convert_checkpoint)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ..convert import FORMATS, SOURCE_LAYOUTS, CheckpointError, convert_checkpoint, detect_layout
from .common import EXIT_CODES, EXIT_OK, ByteProgress, UsageError, check_source
from .model_layout import is_model_spec, layout_of_model

HELP = "convert a checkpoint between LOCAL (flat), FSDP2's DCP, one torch.save file and safetensors"

DESCRIPTION = """Convert a checkpoint offline: on the CPU, in one process, with no process group and no model code;
model and optimizer state.

Target formats (--to):
  local        a DCP directory of {"model": LOCAL_STATE_DICT, "optim": FSDP.optim_state_dict(...)} as fsdp_legacy
               saves it (its flat parameters carry layout records), for any world size
  dcp          a DCP directory with every parameter under its FQN, as FSDP2 (fully_shard) saves and loads it
  full         one torch.save file {"model": {fqn: tensor}, "optim": {"state": ..., "param_groups": ...}}
  safetensors  Hugging Face's layout of the model weights (model.safetensors, or model-0000i-of-0000N.safetensors and
               model.safetensors.index.json), --dtype casting floating tensors, files of at most --max-shard-size;
               the optimizer state is not carried (safetensors holds weights only)

Sources (--from, detected by default): the formats above (a LOCAL one also as per-rank torch.save files of the
LOCAL model state dict: their directory or a quoted glob pattern), and the layouts FSDP1 users have:
  accelerate   the directory Accelerator.save_state writes with the FSDP plugin: pytorch_model_fsdp.bin and
               optimizer.bin (FULL_STATE_DICT), pytorch_model_fsdp_0/ and optimizer_0/ (SHARDED_STATE_DICT, DCP),
               pytorch_model_fsdp_rank{r}.bin (LOCAL_STATE_DICT: see the layout below)
  lightning    Lightning's FSDPStrategy checkpoint: the sharded DCP directory with meta.pt, or the full file (Fabric
               or Trainer)
  verl         verl's per-rank files, model_world_size_{W}_rank_{r}.pt (ShardedTensors of torch's FSDP1, or FSDP2's
               DTensors) and optim_world_size_{W}_rank_{r}.pt (their directory, or a quoted glob); the optimizer
               state of torch FSDP1 without use_orig_params needs --layout-from
  safetensors  a directory in Hugging Face's layout
A LOCAL checkpoint saved without layout records (torch's FSDP1, a plain dcp.save) has its layout inferred from the
optimizer state saved beside it when that trains every parameter (FQNs, shapes and order); otherwise pass
--layout-from. Without use_orig_params a tied parameter's second name cannot be seen there (the report says so).
The optimizer state comes along wherever the source has it (--model-only leaves it out); --strip-prefix takes a
prefix off the names that have it (the Trainer's are the LightningModule's: 'model.' in front of a HF model's names).

Every seal the source's writer made is checked first (CRC-32s of our safetensors data and headers, of our DCP files,
of torch.save archives; a plain dcp.save's items against its metadata): a damaged source is refused with one line
naming the file and tensor, and the report says what was verified and what the source carries no seal for.
Tensors are converted one at a time, the destination is replaced atomically, and what was written is read back and
compared with what was meant to be written bit for bit. Every file is loaded with weights_only=True, but per-rank
files holding ShardedTensors or DTensors, which are unpickled with an allowlist of torch's tensor classes (no code
from the file runs). `fsdp-legacy inspect SOURCE` shows what a checkpoint holds first."""

EXAMPLES = f"""examples:
  fsdp-legacy convert ckpt/local ckpt/fsdp2 --to dcp                     # LOCAL (flat) -> FSDP2's DCP
  fsdp-legacy convert ckpt/fsdp2 ckpt/model.pt --to full                 # -> one torch.save file
  fsdp-legacy convert ckpt/model.pt ckpt/local8 --to local --world-size 8      # -> LOCAL for 8 ranks
  fsdp-legacy convert torch_ckpt/local ckpt/model.pt --to full         # torch FSDP1's LOCAL, model + optimizer
  fsdp-legacy convert torch_ckpt/local ckpt/model.pt --to full --layout-from ckpt/local   # ... layout given
  fsdp-legacy convert plain_dcp/ ckpt/model.pt --to full --layout-from mypkg.models:build --wrap mypkg.models.Layer
  fsdp-legacy convert 'ckpt/rank*.pt' ckpt/fsdp2 --to dcp                # per-rank torch.save files (quoted glob)
  fsdp-legacy convert out/checkpoint-100 hf/ --to safetensors --dtype bfloat16   # Accelerate -> Hugging Face
  fsdp-legacy convert global_step_50/actor ckpt/fsdp2 --to dcp           # verl's per-rank files

{EXIT_CODES}"""

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "convert",
        help=HELP,
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "source",
        help="checkpoint to convert: a DCP directory, a torch.save file, per-rank torch.save files (their directory "
        "or a quoted glob pattern), or a directory Accelerate, Lightning or verl wrote",
    )
    p.add_argument("destination", help="where to write the converted checkpoint")
    p.add_argument("--to", required=True, choices=FORMATS, help="target format")
    p.add_argument(
        "--from",
        dest="source_layout",
        default="auto",
        choices=("auto", *SOURCE_LAYOUTS),
        help="the source's layout (default: detected from its file names)",
    )
    p.add_argument(
        "--dtype",
        type=_dtype,
        help="--to safetensors: cast floating-point tensors to this dtype (bfloat16, float16, float32, ...)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        type=lambda size: int(size) if size.isdigit() else size,
        help="--to safetensors: the largest file, in bytes or as '5GB', '500MB', '2GiB' (default 5GB)",
    )
    p.add_argument("--model-only", action="store_true", help="leave the optimizer state out")
    p.add_argument(
        "--strip-prefix",
        help="take this prefix off the parameter names that start with it (a LightningModule's attribute, e.g. "
        "'model.', before a Hugging Face model's names)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        help="--to local: the world size to lay flat parameters out for (default: the one of the layout)",
    )
    p.add_argument(
        "--layout-from",
        help="a checkpoint carrying the flat-parameter layout (one saved by fsdp_legacy under LOCAL_STATE_DICT, or "
        "converted from one), or the model's code as pkg.mod:factory (a function returning the plain model; with "
        "--wrap): needed for --to local from a checkpoint without it, to read torch FSDP1's LOCAL checkpoints and a "
        "plain dcp.save of a LOCAL state dict whose optimizer state does not give the layout, and verl's FSDP1 "
        "optimizer state",
    )
    p.add_argument(
        "--wrap",
        help="with --layout-from pkg.mod:factory: the dotted class each FSDP unit wraps (e.g. mypkg.models.Layer), "
        "as the checkpoint was saved",
    )
    p.add_argument(
        "--use-orig-params",
        action="store_true",
        help="with --layout-from pkg.mod:factory: the checkpoint was saved with use_orig_params=True",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    p.add_argument("--no-verify", action="store_true", help="skip reading the output back")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run)


def _dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name, getattr(torch, name, None))
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise argparse.ArgumentTypeError(f"{name!r} is not a floating-point dtype (bfloat16, float16, float32, ...)")
    return dtype


def run(args: argparse.Namespace) -> int:
    check_source(args.source)
    if os.path.isfile(args.source) and args.source.endswith(".safetensors"):
        raise UsageError(
            f"{args.source} is one safetensors file: pass the directory that holds it (Hugging Face's layout)."
        )
    layout = None
    if args.layout_from is not None and not os.path.exists(args.layout_from) and is_model_spec(args.layout_from):
        layout = layout_of_model(args.layout_from, args.wrap, args.use_orig_params)
        args.layout_from = None
    elif args.wrap or args.use_orig_params:
        raise UsageError("--wrap and --use-orig-params go with --layout-from pkg.mod:factory (the model's code).")
    elif args.layout_from is not None:
        check_source(args.layout_from, "--layout-from")
    if args.source_layout == "auto":
        try:
            detect_layout(args.source)
        except CheckpointError as error:  # not a checkpoint of any layout: a bad path, not a damaged checkpoint
            raise UsageError(str(error)) from None
    misplaced = [
        option
        for option, given, applies in (
            ("--dtype", args.dtype is not None, args.to == "safetensors"),
            ("--max-shard-size", args.max_shard_size != "5GB", args.to == "safetensors"),
            ("--world-size", args.world_size is not None, args.to == "local"),
            ("--strip-prefix", args.strip_prefix is not None, args.to != "local"),
        )
        if given and not applies
    ]
    if misplaced:
        raise UsageError(
            f"{' and '.join(misplaced)} cannot be used with --to {args.to}: --dtype and --max-shard-size go with --to "
            "safetensors, --world-size with --to local, --strip-prefix with any --to but local."
        )
    parent = os.path.dirname(os.path.abspath(args.destination))
    if not os.path.isdir(parent):
        raise UsageError(f"{parent}, the directory of {args.destination}, does not exist: create it first.")
    if os.path.exists(args.destination) and not args.overwrite:
        raise UsageError(
            f"{args.destination} exists; pass --overwrite to replace it (atomically: the old checkpoint stays intact "
            "until the new one is complete)."
        )
    progress = ByteProgress(args.quiet)
    try:
        report = convert_checkpoint(
            args.source,
            args.destination,
            to=args.to,
            world_size=args.world_size,
            layout_from=args.layout_from,
            verify=not args.no_verify,
            progress=progress,
            source_layout=args.source_layout,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            model_only=args.model_only,
            strip_prefix=args.strip_prefix,
            layout=layout,
        )
    finally:
        progress.close()
    print(report.summary())
    sys.stdout.flush()
    return EXIT_OK
