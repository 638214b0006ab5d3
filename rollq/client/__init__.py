"""The trainer SDK: `RolloutClient` (submit, read results, publish weights), its synchronous
wrapper, and multi-turn `Episodes`. Built on the queue and the registry; nothing below imports it."""

from rollq.client.rollouts import RolloutClient
from rollq.client.sync import SyncRolloutClient

__all__ = ["RolloutClient", "SyncRolloutClient"]
