"""Engines generate one prompt group at a time: `base.Engine` is the whole contract."""

from rollq.engine.base import Engine, EngineDead, Generated, GroupError

__all__ = ["Engine", "EngineDead", "Generated", "GroupError"]
