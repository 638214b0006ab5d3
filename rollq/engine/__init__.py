"""Engines generate one prompt group at a time: `base.Engine` is the whole contract."""

from rollq.engine.base import Engine, EngineDead, GroupError

__all__ = ["Engine", "EngineDead", "GroupError"]
