"""The smallest use: ``Trainer(strategy="megatron_3d")`` on a LightningModule of your own.

The module declares what tensor parallelism may split (``tensor_parallel_plan``); the strategy
string gives the default layout (tensor_parallel_size=1: data parallel over all devices). Pass
a ``Megatron3DStrategy(tensor_parallel_size=2)`` object instead to split the MLP.

    python examples/trainer_strategy_string.py                 # 2 processes, data parallel
    python examples/trainer_strategy_string.py --tensor-parallel-size 2
"""

import argparse

import lightning as L
import torch
from torch import nn

import lightning_megatron as lm  # importing registers strategy="megatron_3d"


class TwoLayerRegressor(L.LightningModule):
    """A plain PyTorch MLP: nothing in it knows about process groups."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(16, hidden)
        self.proj = nn.Linear(hidden, 1)

    def tensor_parallel_plan(self) -> dict[str, str]:
        return {"fc": "column", "proj": "row"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).squeeze(-1), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=50)
    args = parser.parse_args()

    L.seed_everything(0)
    x = torch.randn(512, 16)
    y = x[:, :4].sum(-1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    strategy = "megatron_3d" if args.tensor_parallel_size == 1 else lm.Megatron3DStrategy(
        tensor_parallel_size=args.tensor_parallel_size)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.max_steps,
                        enable_checkpointing=False, logger=False)
    trainer.fit(TwoLayerRegressor(), data)
    if trainer.is_global_zero:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    main()
