"""Where the fp32 main parameters, the optimizer state and (ZeRO-3) the parameters live: the offload tiers.

One idea with two back ends (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021):

* ``"none"``: on the training device (the default).
* ``"cpu"``: in host memory; the optimizer steps there.
* ``"nvme"``: in files under ``offload_path``; the optimizer steps on the host, walking them in tiles through
  a small pool of host buffers (``offload.tiled_step``), so host memory is bounded by the pool, not the model.

``True`` means ``"cpu"`` and ``False``/``None`` ``"none"`` (what ``offload_optimizer=True`` always meant).
This module only names and checks the choice; it knows nothing of the strategy, the optimizer or the files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

TIERS = ("none", "cpu", "nvme")
PARAMETER_TIERS = ("none", "cpu")  # ZeRO-3's parameters: FSDP2 keeps its gradient shards in private host memory
DEFAULT_BUFFER_MB = 64.0
TierOption = Union[bool, str, None]


def tier_of(value: TierOption, *, option: str) -> str:
    """``value`` as one of :data:`TIERS`; ``option`` names the argument in the error."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "cpu"
    if isinstance(value, str) and value.lower() in TIERS:
        return value.lower()
    raise ValueError(f"{option}={value!r} is not one of {TIERS} (or True for 'cpu', False for 'none').")


@dataclass(frozen=True)
class OffloadSettings:
    """The strategy's offload arguments, checked against each other and the ZeRO stage.

    ``optimizer``: the tier of the fp32 main parameters and optimizer state (ZeRO 0-2);
    ``parameters``: the tier of the sharded parameters, their gradients and optimizer state (ZeRO-3);
    ``path``: the folder of the ``"nvme"`` tier's files (a fast local disk); ``buffer_mb``: the size of
    each of the ``"nvme"`` tier's host buffers (the pool holds three tiles: read ahead, step, write behind).
    """

    optimizer: str = "none"
    parameters: str = "none"
    path: Optional[str] = None
    buffer_mb: float = DEFAULT_BUFFER_MB

    @classmethod
    def from_options(cls, *, offload_optimizer: TierOption = False, offload_parameters: TierOption = False,
                     offload_path: Optional[str] = None, offload_buffer_mb: float = DEFAULT_BUFFER_MB,
                     zero_stage: int = 0) -> "OffloadSettings":
        settings = cls(tier_of(offload_optimizer, option="offload_optimizer"),
                       tier_of(offload_parameters, option="offload_parameters"),
                       None if offload_path is None else str(offload_path), float(offload_buffer_mb))
        settings.check(zero_stage)
        return settings

    def check(self, zero_stage: int) -> None:
        """Raise a ``ValueError`` naming the fix for a combination that cannot run (before any process starts)."""
        if self.parameters != "none" and zero_stage != 3:
            raise ValueError(f"offload_parameters={self.parameters!r} offloads the sharded parameters of ZeRO-3; "
                             f"got zero_stage={zero_stage}. Use zero_stage=3, or offload_optimizer="
                             f"{self.parameters!r} to offload only the fp32 main parameters and optimizer state.")
        if self.parameters == "nvme":
            raise ValueError("offload_parameters='nvme' (ZeRO-3's parameters in files) is not supported: FSDP2 makes its "
                             "gradient shards and re-padded parameters in private host memory. Use "
                             "offload_parameters='cpu', or zero_stage=1 or 2 with offload_optimizer='nvme'.")
        if zero_stage == 3 and self.optimizer != "none":
            raise ValueError(f"offload_optimizer={self.optimizer!r} with zero_stage=3: ZeRO-3's optimizer steps on "
                             f"its sharded parameters, so offload them with offload_parameters={self.optimizer!r} "
                             f"(parameters, gradients and optimizer state together), or use zero_stage 0-2.")
        if self.optimizer == "nvme" and not self.path:
            raise ValueError("The 'nvme' offload tier keeps its files under offload_path: pass "
                             "offload_path='/path/on/a/fast/local/disk'.")
        if self.path and self.optimizer != "nvme":
            raise ValueError(f"offload_path={self.path!r} is only used by the 'nvme' tier: set offload_optimizer='nvme', "
                             f"or drop offload_path.")
        if not self.buffer_mb > 0:
            raise ValueError(f"offload_buffer_mb must be > 0, got {self.buffer_mb}.")
