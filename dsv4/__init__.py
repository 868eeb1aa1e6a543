"""dsv4: run, train, serve and verify DeepSeek-V4 models on any PyTorch device."""

from .config import ConfigError, ModelConfig
from .model import DeepSeekV4

__version__ = "0.1.0"
__all__ = ["ModelConfig", "ConfigError", "DeepSeekV4", "__version__"]
