"""The DeepSeek-V4 model: modules that read like the paper."""

from .paged import BatchCache, CacheLayout, PagedKVCache, StepInputs
from .transformer import DeepSeekV4, ModelOutput

__all__ = ["DeepSeekV4", "ModelOutput", "BatchCache", "CacheLayout", "PagedKVCache", "StepInputs"]
