"""The pre-training optimizer recipe shared by the models: AdamW, linear warmup, cosine decay.

Matrices (weights, embeddings) get weight decay; vectors (biases, LayerNorm gains) do not,
as in GPT-2, BERT and Megatron-LM. The learning rate rises linearly for ``warmup_steps``
and then follows a cosine down to ``min_learning_rate`` at the Trainer's last step.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Callable, Mapping

import lightning as L
import torch


def warmup_cosine_factor(
    *, learning_rate: float, min_learning_rate: float, warmup_steps: int, total_steps: int
) -> Callable[[int], float]:
    """The multiplier of ``learning_rate`` at each optimizer step (for ``LambdaLR``).

    Example::

        >>> factor = warmup_cosine_factor(learning_rate=1.0, min_learning_rate=0.1, warmup_steps=2, total_steps=4)
        >>> [round(factor(step), 2) for step in range(5)]
        [0.5, 1.0, 1.0, 0.55, 0.1]
    """
    floor = min_learning_rate / learning_rate

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def adamw_warmup_cosine(
    module: L.LightningModule,
    *,
    learning_rate: float,
    min_learning_rate: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float = 1e-8,
    warmup_steps: int,
) -> dict:
    """What ``configure_optimizers`` returns: AdamW over ``module``'s parameters, stepped per optimizer step.

    The cosine spans ``trainer.estimated_stepping_batches``, so it ends where training ends.
    """
    params = list(module.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=learning_rate,
        betas=betas,
        eps=eps,
    )
    total_steps = max(int(module.trainer.estimated_stepping_batches), 1) if module._trainer is not None else 1
    factor = warmup_cosine_factor(
        learning_rate=learning_rate, min_learning_rate=min_learning_rate, warmup_steps=warmup_steps, total_steps=total_steps
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PretrainingRecipe(L.LightningModule):
    """What the GPT and BERT LightningModules share: the config, their AdamW recipe, and
    hyper-parameters saved under the names ``__init__`` takes (so ``load_from_checkpoint``
    rebuilds the same module)."""

    def init_recipe(self, config_class: type, config: Any, **recipe: Any) -> None:
        """``config``: a preset name, a dict of fields, or a config object; ``recipe``: learning_rate,
        min_learning_rate, weight_decay, betas, adam_eps, warmup_steps."""
        if isinstance(config, str):
            config = config_class.from_name(config)
        elif isinstance(config, dict):
            config = config_class(**config)
        self.config = config
        self.save_hyperparameters({"config": asdict(config), **recipe})
        self.optimizer_settings = {("eps" if name == "adam_eps" else name): value for name, value in recipe.items()}

    def configure_optimizers(self):
        return adamw_warmup_cosine(self, **self.optimizer_settings)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs: Any):
        """Lightning's loader, which also reads sharded checkpoint directories (any saving layout) into one
        process: the module is rebuilt from the saved hyper-parameters (``kwargs`` override them).

        Example::

            model = GPT.load_from_checkpoint("runs/checkpoints/last.ckpt")   # a directory written by 8 ranks
        """
        from lightning_megatron.checkpoint.sharded import consolidated_state_dict, is_sharded_checkpoint, open_sharded

        if not is_sharded_checkpoint(checkpoint_path):
            return super().load_from_checkpoint(checkpoint_path, map_location=map_location, hparams_file=hparams_file,
                                                strict=strict, **kwargs)
        hyper_parameters = open_sharded(checkpoint_path).trainer_state().get("hyper_parameters", {})
        module = cls(**{**hyper_parameters, **kwargs})
        module.configure_model()
        module.load_state_dict(consolidated_state_dict(checkpoint_path), strict=True if strict is None else strict)
        return module.to(map_location) if isinstance(map_location, (str, torch.device)) else module

    @classmethod
    def _with_model_state_dict(cls, config: Any, state_dict: Mapping[str, torch.Tensor], **kwargs: Any):
        """A module built on this process with ``config`` whose ``model`` holds ``state_dict`` (its full state
        dict); ``kwargs`` are the recipe's, e.g. ``learning_rate``. What ``from_hf`` returns."""
        module = cls(config, **kwargs)
        module.configure_model()
        module.model.load_state_dict(state_dict)
        return module
