"""Started as ``python bad_sft_data.py OUT_DIR`` with devices=2 (Lightning's launcher starts rank 1): fine-tuning
data whose second line is not JSON. Rank 0 reads it (the others wait for its token cache) and fails; rank 1 fails
because rank 0 did."""

import sys
from pathlib import Path

import lightning as L

from trainer_setup import model, trainer_kwargs
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.data import SFTDataModule

data = Path(sys.argv[1]) / "chats.jsonl"
data.write_text('{"prompt": "hi", "response": "yo"}\n{"prompt": "unclosed\n{"prompt": "a", "response": "b"}\n')
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=Megatron3DStrategy(), **trainer_kwargs({"steps": 2}))
trainer.fit(model({}), datamodule=SFTDataModule(data_path=str(data), seq_length=32, global_batch_size=4))
