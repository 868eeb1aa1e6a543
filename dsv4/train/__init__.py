"""Training DeepSeek-V4: data and tokenizer, losses, Muon/AdamW, balancing, trainer, checkpoints."""

from ..tokenizer import Tokenizer
from .trainer import TrainConfig, Trainer, train

__all__ = ["Tokenizer", "TrainConfig", "Trainer", "train"]
