"""ShardedGradScaler: torch.amp.GradScaler for sharded gradients (fp16 mixed precision with FSDP).

Each rank checks only its own shards for inf/nan, so the verdict is summed across the process group: every rank then
skips (or takes) the same step and backs the scale off (or grows it) identically.
"""

import torch
import torch.distributed as dist


class ShardedGradScaler(torch.amp.GradScaler):
    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group if process_group is not None else dist.group.WORLD

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # fp16 gradients are expected here (MixedPrecision(keep_low_precision_grads=True)), unlike with plain AMP.
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if not self._enabled:
            return
        found_per_device = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        # One collective, whatever devices this rank's gradients sit on (CPUOffload puts them on the CPU).
        total = torch.zeros((), device=self._device)
        for found in found_per_device.values():
            total += found.to(total.device)
        dist.all_reduce(total, group=self.process_group)
        for found in found_per_device.values():
            found.copy_(total)
