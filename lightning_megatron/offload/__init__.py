"""Offload tiers: fp32 main parameters, optimizer state and ZeRO-3 parameters in host memory or on NVMe."""

from lightning_megatron.offload.settings import DEFAULT_BUFFER_MB, PARAMETER_TIERS, TIERS, OffloadSettings, tier_of

__all__ = ["DEFAULT_BUFFER_MB", "PARAMETER_TIERS", "TIERS", "OffloadSettings", "tier_of"]
