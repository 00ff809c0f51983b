"""Tiny LightningModules for the fault-lifecycle tests: two linear layers built in ``configure_model``
(so under Megatron3DStrategy they start on the meta device), trained on random regression data."""

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Unplanned(L.LightningModule):
    """Declares no ``tensor_parallel_plan()``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return F.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator))
        return DataLoader(data, batch_size=4)


class Planned(Unplanned):
    """Declares ``plan`` (Megatron's MLP split by default: column then row, one all-reduce forward)."""

    def __init__(self, plan=None) -> None:
        super().__init__()
        self.plan = {"net.0": "column", "net.2": "row"} if plan is None else plan

    def tensor_parallel_plan(self):
        return self.plan


# The stall scenario: rank 1 sleeps STALL_SECONDS at step 2 under timeout=STALL_TIMEOUT_SECONDS.
STALL_SECONDS = 60
STALL_TIMEOUT_SECONDS = 5

# A plan entry that names no submodule: parallelize raises while every parameter is still on the meta device.
MISNAMED_PLAN = {"net.fc": "column", "net.2": "row"}
MISNAMED_ERROR = "The tensor-parallel plan entry 'net.fc' matches no submodule of Planned"


def trainer_kwargs(**extra):
    return dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, **extra)
