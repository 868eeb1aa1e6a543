"""dsv4: run, train, serve and verify DeepSeek-V4 models on any PyTorch device.

`import dsv4` is light: ModelConfig, ConfigError and DeepSeekV4 (which import torch) load on first use, so
that `dsv4 --help` answers at once and Ctrl-C while torch loads ends the command line cleanly.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["ModelConfig", "ConfigError", "DeepSeekV4", "__version__"]


def __getattr__(name: str):
    if name in ("ModelConfig", "ConfigError"):
        from . import config

        return getattr(config, name)
    if name == "DeepSeekV4":
        from .model import DeepSeekV4

        return DeepSeekV4
    raise AttributeError(f"module 'dsv4' has no attribute {name!r}")
