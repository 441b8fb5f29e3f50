"""An FSDP1 program in the style of dinov2's self-supervised trainer (dinov2/fsdp, dinov2/train/ssl_meta_arch.py): a
meta-architecture holding a student and a teacher, each a dict of submodels (backbone, head) wrapped one by one by a
factory, get_fsdp_wrapper, that reads a config dict (the sharding strategy by name, the mixed-precision dtypes by
name) and returns a functools.partial of FSDP with a ModuleWrapPolicy over the classes it is given. The teacher
starts as a copy of the student, is frozen, runs under no_grad, and follows the student by EMA over its parameters
(torch._foreach_* ops), and `FSDP.fsdp_modules` counts the units; a DINO-style loss keeps a center buffer
(all-reduced) outside FSDP. The checkpointer saves and restores the whole meta-architecture (a plain module holding
the four FSDP roots) under SHARDED_STATE_DICT with torch.distributed.checkpoint. Rank 0 prints its loss per step,
the number of FSDP units, and the teacher's parameter norm read under summon_full_params at the end.

Each FSDP root here holds no parameters of its own (its submodules are the units): an FSDP1 root run under no_grad
keeps its gathered parameters until the next forward, which then reads them stale after the EMA; dinov2 frees them
with FSDP1's private `_reshard`, which is out of this program's scope.

    --steps N [--save DIR --save-after K]        train, saving after step K
    --steps N --resume DIR                       restore DIR (its iteration says where to go on)
"""

import argparse
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

CONFIG = {
    "compute_precision": {
        "student": {
            "backbone": {
                "sharding_strategy": "SHARD_GRAD_OP",
                "mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            },
            "head": {
                "sharding_strategy": "FULL_SHARD",
                "mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            },
        },
        "teacher": {
            "backbone": {
                "sharding_strategy": "FULL_SHARD",
                "mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            },
            "head": {
                "sharding_strategy": "FULL_SHARD",
                "mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            },
        },
    },
    "teacher_momentum": 0.9,
}


def get_fsdp_wrapper(model_cfg, modules_to_wrap=frozenset()):
    sharding_strategy_dict = {
        "NO_SHARD": ShardingStrategy.NO_SHARD,
        "SHARD_GRAD_OP": ShardingStrategy.SHARD_GRAD_OP,
        "FULL_SHARD": ShardingStrategy.FULL_SHARD,
    }
    dtype_dict = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    precision = model_cfg["mixed_precision"]
    mixed_precision_config = MixedPrecision(
        param_dtype=dtype_dict[precision["param_dtype"]],
        reduce_dtype=dtype_dict[precision["reduce_dtype"]],
        buffer_dtype=dtype_dict[precision["buffer_dtype"]],
    )
    return partial(
        FSDP,
        sharding_strategy=sharding_strategy_dict[model_cfg["sharding_strategy"]],
        mixed_precision=mixed_precision_config,
        device_id=torch.device("cpu"),
        sync_module_states=True,
        use_orig_params=True,
        auto_wrap_policy=ModuleWrapPolicy(modules_to_wrap),
    )


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(patch, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class Backbone(nn.Module):
    def __init__(self, patch: int = 8, dim: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(patch, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x).mean(dim=1)  # pooled tokens


class DINOHead(nn.Module):
    def __init__(self, dim: int = 16, out_dim: int = 32) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.last_layer = nn.Linear(dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(nn.functional.normalize(self.mlp(x), dim=-1))


class DINOLoss(nn.Module):
    def __init__(self, out_dim: int = 32, student_temp: float = 0.1, center_momentum: float = 0.9) -> None:
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))

    @torch.no_grad()
    def softmax_center_teacher(self, teacher_output: torch.Tensor, teacher_temp: float) -> torch.Tensor:
        return torch.softmax((teacher_output - self.center) / teacher_temp, dim=-1)

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        batch_center = teacher_output.sum(dim=0, keepdim=True)
        dist.all_reduce(batch_center)
        batch_center = batch_center / (len(teacher_output) * dist.get_world_size())
        self.center.mul_(self.center_momentum).add_(batch_center, alpha=1 - self.center_momentum)

    def forward(self, student_output: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
        log_probs = nn.functional.log_softmax(student_output / self.student_temp, dim=-1)
        return -(teacher_probs * log_probs).sum(dim=-1).mean()


class SSLMetaArch(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.cfg = cfg
        self.student = nn.ModuleDict({"backbone": Backbone(), "head": DINOHead()})
        self.teacher = nn.ModuleDict({"backbone": Backbone(), "head": DINOHead()})
        self.dino_loss = DINOLoss()
        for p in self.teacher.parameters():
            p.requires_grad = False

    def prepare_for_distributed_training(self) -> None:
        wrapped = {"backbone": {PatchEmbed, Block}, "head": {nn.Linear}}
        for k in self.student.keys():
            self.teacher[k].load_state_dict(self.student[k].state_dict())
            student_model_cfg = self.cfg["compute_precision"]["student"][k]
            self.student[k] = get_fsdp_wrapper(student_model_cfg, modules_to_wrap=wrapped[k])(self.student[k])
            teacher_model_cfg = self.cfg["compute_precision"]["teacher"][k]
            self.teacher[k] = get_fsdp_wrapper(teacher_model_cfg, modules_to_wrap=wrapped[k])(self.teacher[k])

    def forward_backward(self, student_crops: torch.Tensor, teacher_crops: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher_output = self.teacher["head"](self.teacher["backbone"](teacher_crops))
            teacher_probs = self.dino_loss.softmax_center_teacher(teacher_output, teacher_temp=0.04)
            self.dino_loss.update_center(teacher_output)
        student_output = self.student["head"](self.student["backbone"](student_crops))
        loss = self.dino_loss(student_output, teacher_probs)
        loss.backward()
        return loss

    @torch.no_grad()
    def update_teacher(self, m: float) -> None:
        student_param_list = []
        teacher_param_list = []
        for k in self.student.keys():
            student_param_list += list(self.student[k].parameters())
            teacher_param_list += list(self.teacher[k].parameters())
        torch._foreach_mul_(teacher_param_list, m)
        torch._foreach_add_(teacher_param_list, student_param_list, alpha=1 - m)

    def units(self) -> int:
        return sum(len(FSDP.fsdp_modules(self.student[k])) for k in self.student.keys())


class FSDPCheckpointer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, save_dir: str) -> None:
        self.model = model
        self.optimizer = optimizer
        self.save_dir = save_dir

    def save(self, iteration: int) -> None:
        with FSDP.state_dict_type(self.model, StateDictType.SHARDED_STATE_DICT):
            data = {"model": self.model.state_dict(), "optimizer": FSDP.optim_state_dict(self.model, self.optimizer)}
        data["iteration"] = torch.tensor(iteration)
        dcp.save(data, checkpoint_id=self.save_dir)

    def load(self) -> int:
        with FSDP.state_dict_type(self.model, StateDictType.SHARDED_STATE_DICT):
            data = {"model": self.model.state_dict(), "optimizer": FSDP.optim_state_dict(self.model, self.optimizer)}
            data["iteration"] = torch.tensor(0)
            dcp.load(data, checkpoint_id=self.save_dir)
            self.model.load_state_dict(data["model"])
            self.optimizer.load_state_dict(FSDP.optim_state_dict_to_load(self.model, self.optimizer, data["optimizer"]))
        return int(data["iteration"])


def crops(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    images = torch.randn(4, 6, 8, generator=generator)  # 4 images of 6 patches of 8 values
    student = images + 0.3 * torch.randn(images.shape, generator=generator)
    teacher = images + 0.1 * torch.randn(images.shape, generator=generator)
    return student, teacher


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save")
    parser.add_argument("--save-after", type=int, default=-1)
    parser.add_argument("--resume")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = SSLMetaArch(CONFIG)
    model.prepare_for_distributed_training()
    params_groups = [{"params": model.student[k].parameters(), "weight_decay": 0.04} for k in model.student.keys()]
    optimizer = torch.optim.AdamW(params_groups, lr=5e-3, betas=(0.9, 0.99))
    start = 0
    if args.resume:
        start = FSDPCheckpointer(model, optimizer, args.resume).load()
    if rank == 0:
        print(f"units {model.units()}")
    for iteration in range(start, args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model.forward_backward(*crops(iteration, rank))
        optimizer.step()
        model.update_teacher(CONFIG["teacher_momentum"])
        if rank == 0:
            print(f"loss {loss.item()!r}")
        if iteration == args.save_after:
            FSDPCheckpointer(model, optimizer, args.save).save(iteration + 1)
    with FSDP.summon_full_params(model.teacher["backbone"], writeback=False):
        norm = sum(p.double().pow(2).sum().item() for p in model.teacher["backbone"].parameters())
    if rank == 0:
        print(f"norm {norm!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
