"""The DeepSeek-V4 model: modules that read like the paper."""

from .transformer import DeepSeekV4, ModelCache, ModelOutput

__all__ = ["DeepSeekV4", "ModelCache", "ModelOutput"]
