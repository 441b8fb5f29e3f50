"""The one seam to torch's fake process group, with which one process plays any rank of any world size.

torch ships it for its own tests (`torch.testing._internal.distributed.fake_pg`, backend "fake"): collectives return
at once without touching data, which is all the estimator needs since its tensors are fake too. It is internal API,
so it is imported here only, when an estimate runs.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group


@contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """A default process group of `world_size` fake ranks in which this process is `rank`."""
    if dist.is_initialized():
        raise RuntimeError(
            "The memory estimator needs a process without a process group (it installs a fake one of the world size "
            "to estimate): call it before init_process_group, or run tools/mem_report.py."
        )
    from torch.testing._internal.distributed import fake_pg  # registers the "fake" backend

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)
    try:
        yield _get_default_group()
    finally:
        dist.destroy_process_group()
