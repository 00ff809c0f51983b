"""Using a trained decoder: generation with a key/value cache and full-vocabulary logits, at any layout."""

from lightning_megatron.generation.generate import full_logits, generate, left_pad
from lightning_megatron.generation.kv_cache import KVCache
from lightning_megatron.generation.sampling import SamplingSettings, VocabParallelSampler

__all__ = ["KVCache", "SamplingSettings", "VocabParallelSampler", "full_logits", "generate", "left_pad"]
