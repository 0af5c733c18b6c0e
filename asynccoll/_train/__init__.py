"""Data-parallel training on top of the public collectives: :class:`GradSync`."""

from .gradsync import GradSync as GradSync

__all__ = ["GradSync"]
