"""Training recipes. Stage 1 (paper §3.1.3): :func:`fbs.train.stage1.train` with a :class:`TrainConfig`."""

from .config import TrainConfig, TrainConfigError
from .losses import LossParts, LossWeights, Stage1Loss

__all__ = ["TrainConfig", "TrainConfigError", "LossParts", "LossWeights", "Stage1Loss"]
