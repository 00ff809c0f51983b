"""The pre-training optimizer recipe shared by the models: AdamW, linear warmup, cosine decay.

Matrices (weights, embeddings) get weight decay; vectors (biases, LayerNorm gains) do not,
as in GPT-2, BERT and Megatron-LM. The learning rate rises linearly for ``warmup_steps``
and then follows a cosine down to ``min_learning_rate`` at the Trainer's last step. A run with no
last step (``Trainer(max_time=..., max_steps=-1)``, or ``max_epochs=-1``) has no cosine to follow:
the learning rate warms up and then holds at ``learning_rate``.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from typing import Any, Callable, Mapping, Optional, Union

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_megatron.models.formats import HFFormat, sharded_checkpoint_reader
from lightning_megatron.optim.cpu_adam import CPUAdamW
from lightning_megatron.parallel.names import is_adapter_name


def warmup_cosine_factor(
    *, learning_rate: float, min_learning_rate: float, warmup_steps: int, total_steps: Optional[int]
) -> Callable[[int], float]:
    """The multiplier of ``learning_rate`` at each optimizer step (for ``LambdaLR``).

    ``total_steps=None`` (no horizon): after the warmup the multiplier stays 1.

    Example::

        >>> factor = warmup_cosine_factor(learning_rate=1.0, min_learning_rate=0.1, warmup_steps=2, total_steps=4)
        >>> [round(factor(step), 2) for step in range(5)]
        [0.5, 1.0, 1.0, 0.55, 0.1]
        >>> factor = warmup_cosine_factor(learning_rate=1.0, min_learning_rate=0.1, warmup_steps=2, total_steps=None)
        >>> [round(factor(step), 2) for step in range(5)]
        [0.5, 1.0, 1.0, 1.0, 1.0]
    """
    floor = min_learning_rate / learning_rate

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps is None:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


ADAM_IMPLEMENTATIONS = ("auto", "cpu_kernel", "fused", "foreach", "for_loop")


def adamw_implementation(params: list[torch.Tensor], implementation: str = "auto", *,
                         mixed_precision: bool = False) -> dict[str, bool]:
    """AdamW's ``fused``/``foreach`` arguments for ``implementation``.

    ``"auto"``: one fused kernel per step over all tensors (torch has it for CPU and CUDA) when every parameter
    is a floating-point tensor on a device that has it; else the multi-tensor (foreach) kernels. Not torch's own
    default, which on CPU is a Python loop over the tensors, one kernel per operation and tensor
    (measured once: ``benchmarks/README.md``, "Recorded results"). The choice is made on the model's parameters and
    kept in the param groups, so it also applies once the distributed optimizer rebinds them to fp32 pieces
    (``optim.main_params``), which are floating-point tensors of the same device or, offloaded, of the CPU.
    ``mixed_precision``: the Trainer runs Lightning's ``MixedPrecision`` plugin (``16-mixed``, ``bf16-mixed``);
    ``"auto"`` then takes foreach, because that plugin refuses to clip the gradients of a fused optimizer (which
    could unscale fp16 gradients inside its step). DTensor parameters (another strategy's) get torch's default.
    """
    if implementation not in ADAM_IMPLEMENTATIONS:
        raise ValueError(f"adam_implementation={implementation!r} is not one of {ADAM_IMPLEMENTATIONS}.")
    if implementation == "auto":
        if any(isinstance(p, DTensor) for p in params):
            # Another strategy's DTensor parameters (Lightning's ModelParallelStrategy, FSDP2): torch's own choice,
            # which knows which kernels take DTensors (its fused AdamW refuses a mix of DTensors and tensors).
            return {"fused": None, "foreach": None}
        fused_devices = torch.utils._foreach_utils._get_fused_kernels_supported_devices()
        fusable = not mixed_precision and all(p.is_floating_point() and p.device.type in fused_devices for p in params)
        implementation = "fused" if fusable else "foreach"
    return {"fused": implementation == "fused", "foreach": implementation == "foreach"}


def adamw_optimizer(groups: list[dict], implementation: str = "auto", *, mixed_precision: bool = False,
                    **hyper: Any) -> torch.optim.AdamW:
    """AdamW over param ``groups`` (``hyper``: lr, betas, eps, weight_decay) with ``implementation``'s kernels.

    ``"cpu_kernel"``: :class:`~lightning_megatron.optim.cpu_adam.CPUAdamW`, one parallel pass over all float32 CPU
    tensors per step (as fast as DeepSpeed's ``DeepSpeedCPUAdam`` or faster, and faster than torch's fused CPU
    kernel: ``benchmarks/cpu_adam.py``), with :func:`adamw_implementation`'s ``"auto"`` kernels for other tensors.
    ``"auto"`` takes it too: its kernel steps whichever tensors are in host memory when it steps (CPU parameters,
    or the fp32 pieces an offload tier rebinds it to: ``optim.main_params``) and leaves accelerator tensors to
    :func:`adamw_implementation`'s kernels, so the recipe need not know where the strategy will step it.
    DTensor parameters (another strategy's) get ``torch.optim.AdamW`` with torch's default kernels.
    """
    params = [p for group in groups for p in group["params"]]
    if implementation == "auto" and not any(isinstance(p, DTensor) for p in params):
        implementation = "cpu_kernel"
    if implementation == "cpu_kernel":
        return CPUAdamW(groups, **hyper, **adamw_implementation(params, "auto", mixed_precision=mixed_precision))
    return torch.optim.AdamW(groups, **hyper, **adamw_implementation(params, implementation,
                                                                      mixed_precision=mixed_precision))


def adamw_warmup_cosine(
    module: L.LightningModule,
    *,
    learning_rate: float,
    min_learning_rate: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float = 1e-8,
    warmup_steps: int,
    implementation: str = "auto",
) -> dict:
    """What ``configure_optimizers`` returns: AdamW over ``module``'s trainable parameters (``requires_grad``: under
    LoRA the adapters only), stepped per optimizer step.

    The cosine spans ``trainer.estimated_stepping_batches`` (warmup included), so it ends where training
    ends. When the Trainer has no last step (``max_time`` with ``max_steps=-1``, or ``max_epochs=-1``),
    the learning rate warms up and then holds at ``learning_rate`` (an info message says so): set
    ``Trainer(max_steps=...)`` for the cosine. ``implementation``: ``"auto"`` (this
    package's CPU kernel for what steps on the CPU, else fused where the device has it), ``"cpu_kernel"``,
    ``"fused"``, ``"foreach"`` or ``"for_loop"`` (:func:`adamw_optimizer`).
    """
    params = [p for p in module.parameters() if p.requires_grad]  # frozen ones (a LoRA base) get no state
    optimizer = adamw_optimizer(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        implementation,
        mixed_precision=_lightning_mixed_precision(module),
        lr=learning_rate,
        betas=betas,
        eps=eps,
    )
    total_steps = _training_horizon(module, warmup_steps)
    factor = warmup_cosine_factor(
        learning_rate=learning_rate, min_learning_rate=min_learning_rate, warmup_steps=warmup_steps, total_steps=total_steps
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _lightning_mixed_precision(module: L.LightningModule) -> bool:
    """Whether the Trainer runs Lightning's ``MixedPrecision`` plugin (``16-mixed``, ``bf16-mixed``)."""
    return module._trainer is not None and isinstance(module.trainer.precision_plugin, MixedPrecision)


def _training_horizon(module: L.LightningModule, warmup_steps: int) -> Optional[int]:
    """The optimizer steps the Trainer will run, or None when it has no last step (stopped by time, or never)."""
    if module._trainer is None:
        return 1
    steps = module.trainer.estimated_stepping_batches
    if math.isinf(steps):
        rank_zero_info(
            f"{type(module).__name__}: the Trainer has no last step (max_steps=-1 with max_time or max_epochs=-1), "
            f"so the learning rate warms up for {warmup_steps} steps and then holds at learning_rate; set "
            f"Trainer(max_steps=...) for the cosine decay to min_learning_rate.")
        return None
    return max(int(steps), 1)


def load_base_weights(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, what: str) -> None:
    """Load a full state dict of the base model (a Hugging Face model's, converted) into ``model``, whose LoRA
    adapters, if any, keep their start: every other parameter must be there, and nothing else."""
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [name for name in missing if not is_adapter_name(name)]
    if missing or unexpected:
        raise RuntimeError(f"{what} do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}.")


class PretrainingRecipe(L.LightningModule):
    """What the GPT, BERT and HFCausalLM LightningModules share: the config, their AdamW recipe,
    hyper-parameters saved under the names ``__init__`` takes (so ``load_from_checkpoint``
    rebuilds the same module), and the logged loss per counted token of the global batch."""

    def init_recipe(self, config_class: type, config: Any, *, config_fields: Callable[[Any], dict] = asdict,
                    **recipe: Any) -> None:
        """``config``: a preset name, a dict of fields, or a config object; ``recipe``: learning_rate,
        min_learning_rate, weight_decay, betas, adam_eps, warmup_steps, adam_implementation. ``config_fields``: the
        config as the dict of fields saved in the hyper-parameters (a dataclass's ``asdict`` by default)."""
        if isinstance(config, str):
            config = config_class.from_name(config)
        elif isinstance(config, dict):
            config = config_class(**config)
        self.config = config
        adamw_implementation([], recipe.get("adam_implementation", "auto"))  # a bad name fails here, not at fit
        self.save_hyperparameters({"config": config_fields(config), **recipe})
        names = {"adam_eps": "eps", "adam_implementation": "implementation"}
        self.optimizer_settings = {names.get(name, name): value for name, value in recipe.items()}

    def configure_optimizers(self):
        return adamw_warmup_cosine(self, **self.optimizer_settings)

    def global_token_mean(self, loss_sum: Tensor, num_tokens: Tensor) -> Tensor:
        """The batch's loss per counted token over all data-parallel ranks (what ``train_loss`` logs): not the mean
        of the ranks' means, which differs when ranks count different numbers of tokens (SFT's response-only labels,
        packed samples)."""
        totals = torch.stack([loss_sum.detach().float(), num_tokens.detach().float()])
        if self._trainer is not None:
            totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        return totals[0] / totals[1].clamp(min=1)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Logs ``consumed_tokens/<dataset>`` when the data module reports them (a blend of datasets: see
        ``GPTDataModule.consumed_tokens``); the counts are the same on every rank."""
        consumed = getattr(getattr(self.trainer, "datamodule", None), "consumed_tokens", None)
        for name, tokens in (consumed() if callable(consumed) else {}).items():
            self.log(f"consumed_tokens/{name}", float(tokens), on_step=True, on_epoch=False)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs: Any):
        """Lightning's loader, which also reads sharded checkpoint directories (any saving layout) into one
        process: the module is rebuilt from the saved hyper-parameters (``kwargs`` override them).

        Example::

            model = GPT.load_from_checkpoint("runs/checkpoints/last.ckpt")   # a directory written by 8 ranks
        """
        reader = sharded_checkpoint_reader()
        reference = reader.base_reference(checkpoint_path) if reader is not None else None
        if reader is None or not (reader.is_sharded(checkpoint_path) or reference is not None):
            return super().load_from_checkpoint(checkpoint_path, map_location=map_location, hparams_file=hparams_file,
                                                strict=strict, **kwargs)
        hyper = reader.hyper_parameters(checkpoint_path)
        if reference is None and hyper.get("pretrained") is not None:
            hyper = {**hyper, "pretrained": None}  # the checkpoint holds every weight: the base is not read
        module = cls(**{**hyper, **kwargs})
        module.configure_model()
        strict = True if strict is None else strict
        if reference is None:
            module.load_state_dict(reader.state_dict(checkpoint_path), strict=strict)
        else:  # adapters only (checkpoint/base.py): the base came from ``pretrained`` in configure_model
            reader.load_adapters(reference, module, reader.state_dict(checkpoint_path), strict)
        return module.to(map_location) if isinstance(map_location, (str, torch.device)) else module

    @staticmethod
    def hf_format() -> HFFormat:
        """The Hugging Face converter of this model's config class (``models/formats.py``); each model names its own."""
        raise NotImplementedError

    @classmethod
    def from_hf(cls, model_or_dir: Union[str, os.PathLike, nn.Module], **kwargs: Any):
        """A module holding the weights of a Hugging Face model of this model's families (see ``hf_format``): the
        model itself or its ``save_pretrained`` directory; ``kwargs`` are the recipe's, e.g. ``learning_rate``.

        Example::

            model = GPT.from_hf("path/to/Llama-3.2-1B", learning_rate=1e-4)   # fine-tune at any layout
        """
        config, state_dict = cls.hf_format().read(model_or_dir)
        module = cls(config, **kwargs)
        module.configure_model()
        load_base_weights(module.model, state_dict, what=f"The Hugging Face weights of {type(model_or_dir).__name__}")
        return module

    def to_hf(self, out_dir: Union[str, os.PathLike], *, state_dict: Optional[Mapping[str, torch.Tensor]] = None,
              model_type: Optional[str] = None, max_shard_size: Union[int, str, None] = None, **hf_config: Any) -> None:
        """Write a directory that ``from_pretrained`` of the matching ``transformers`` class loads.

        ``model_type`` picks the family where several can hold this config (a Llama-shaped GPT: ``"llama"`` by
        default, ``"mistral"``, ``"qwen2"``); ``max_shard_size`` (default 5GB) splits the weights into
        ``model-0000k-of-0000N.safetensors`` files; ``hf_config``: extra ``config.json`` fields. A module made with
        ``pretrained=DIR`` takes DIR's tokenizer files, ``generation_config.json`` and special token ids along, so
        ``transformers`` and ``lightning-megatron generate`` use the directory as is. LoRA adapters are merged into
        the weights they adapt (a QLoRA module is refused: export its checkpoint with ``checkpoint convert``).
        Under tensor or pipeline parallelism this module holds shards: gather on every rank, write on one::

            state_dict = trainer.strategy.full_state_dict()
            if trainer.is_global_zero:
                model.to_hf("exported", state_dict=state_dict)
        """
        lora = {"lora": self.lora} if getattr(self, "lora", None) is not None else {}  # merged into the weights
        self.hf_format().write(out_dir, self.config, self.state_dict() if state_dict is None else state_dict,
                               model_type=model_type, max_shard_size=max_shard_size,
                               base=self.hparams.get("pretrained"), **lora, **hf_config)
