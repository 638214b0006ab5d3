"""rollq: a rollout service for asynchronous / off-policy RL of language models."""

from rollq.client import RolloutClient, SyncRolloutClient
from rollq.images import ImageRef
from rollq.protocol import GroupResult, InvalidInput, QueueFull, Sample, Sampling

__all__ = ["RolloutClient", "SyncRolloutClient", "GroupResult", "InvalidInput", "QueueFull",
           "Sample", "Sampling", "ImageRef"]
__version__ = "0.1.0"
