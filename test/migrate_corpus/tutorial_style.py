"""An FSDP1 program in the style of torch's FSDP tutorial (FSDP_mnist.py): a small convolutional net on generated
12x12 images, size_based_auto_wrap_policy through functools.partial, a train function per epoch (the loss summed
across ranks with all_reduce), Adadelta with StepLR, a FULL checkpoint (offload_to_cpu + rank0_only) written with
torch.save on rank 0, and the parameters read under summon_full_params at the end. Rank 0 prints its loss per step.

    --epochs N [--save PATH --save-epoch K]   train epochs 1..N, saving after epoch K
    --epochs N --resume PATH                  load PATH (every rank), then train the epochs after it
"""

import argparse
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.fc1 = nn.Linear(128, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


def train(model, rank, train_loader, optimizer, epoch, sampler=None):
    model.train()
    ddp_loss = torch.zeros(2)
    if sampler:
        sampler.set_epoch(epoch)
    for data, target in train_loader:
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target, reduction="sum")
        loss.backward()
        optimizer.step()
        ddp_loss[0] += loss.item()
        ddp_loss[1] += len(data)
        if rank == 0:
            print(f"loss {loss.item()!r}")
    dist.all_reduce(ddp_loss, op=dist.ReduceOp.SUM)
    if rank == 0:
        print(f"Train Epoch: {epoch} \tLoss: {ddp_loss[0] / ddp_loss[1]:.6f}")


def save_checkpoint(model, optimizer, scheduler, epoch, path, rank):
    save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_policy = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy, optim_policy):
        states = model.state_dict()
        optim_states = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        torch.save({"model": states, "optim": optim_states, "scheduler": scheduler.state_dict(), "epoch": epoch}, path)
    dist.barrier()


def load_checkpoint(model, optimizer, scheduler, path):
    checkpoint = torch.load(path, weights_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, checkpoint["optim"]))
    scheduler.load_state_dict(checkpoint["scheduler"])
    return checkpoint["epoch"] + 1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--save")
    parser.add_argument("--save-epoch", type=int, default=-1)
    parser.add_argument("--resume")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    generated = torch.Generator().manual_seed(0)
    images = torch.randn(64, 1, 12, 12, generator=generated)
    labels = torch.randint(0, 10, (64,), generator=generated)
    dataset = TensorDataset(images, labels)
    sampler = DistributedSampler(dataset, rank=rank, num_replicas=world_size, shuffle=True)
    train_loader = DataLoader(dataset, batch_size=8, sampler=sampler)

    my_auto_wrap_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=200)
    torch.manual_seed(0)
    model = Net()
    model = FSDP(model, auto_wrap_policy=my_auto_wrap_policy, device_id=torch.device("cpu"))
    optimizer = optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    first = load_checkpoint(model, optimizer, scheduler, args.resume) if args.resume else 1
    for epoch in range(first, args.epochs + 1):
        train(model, rank, train_loader, optimizer, epoch, sampler=sampler)
        scheduler.step()
        if epoch == args.save_epoch:
            save_checkpoint(model, optimizer, scheduler, epoch, args.save, rank)

    with FSDP.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
        if rank == 0:
            squares = {name: p.double().pow(2).sum().item() for name, p in model.named_parameters()}
            print(f"norm {sum(squares.values())!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
