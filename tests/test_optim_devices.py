"""The optimizer path's collectives take tensors on the run's device, also where this rank holds nothing to reduce
(NCCL refuses host tensors; gloo takes them, so a CPU run needs the check to see it)."""

import pytest
import torch

from lightning_megatron.optim.grad_sync import GradientSynchronizer
from lightning_megatron.parallel.guards import check_collective_devices


def test_a_rank_without_trainable_parameters_sums_its_token_count_on_the_runs_device(one_rank_group):
    """A pipeline stage whose parameters are all frozen has no bucket to take the device from. ``meta`` stands for
    the accelerator: the collective runs there, and only reading the summed count back (which a meta tensor
    cannot give) stops the step."""
    sync = GradientSynchronizer([torch.nn.Parameter(torch.zeros(3), requires_grad=False)],
                                data_parallel_group=one_rank_group, device=torch.device("meta"))
    sync.start_micro_batch(sync=True)
    with check_collective_devices("meta") as checked, pytest.raises(RuntimeError, match="meta tensors"):
        sync.finish(torch.tensor(5.0))
    assert not sync.buckets and checked["all_reduce"] == 1
