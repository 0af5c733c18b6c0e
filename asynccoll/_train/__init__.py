"""Data-parallel training on top of the public collectives: :class:`GradSync` (API.md §9)."""

from .gradsync import GradSync as GradSync

__all__ = ["GradSync"]
