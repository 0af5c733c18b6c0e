"""The chaos soak's second communicator: a subgroup made with ``comm.split`` beside the world.

After every membership change (the first members' start, a shrink, a grow) the ranks split
the world communicator into pairs of consecutive ranks (``[[0, 1], [2, 3]]`` at 4 ranks,
``[[0, 1], [2]]`` at 3) and every ``SPLIT_EVERY``-th step runs an all-reduce on this rank's
pair, checked against the pair's values. A failure there (a pair member killed or frozen)
is a failure like any other: the world shrinks (without the pair member that died, by
name), and the pairs are made again on the new communicator; the old pair is closed. A
failure of the world aborts this rank's pair first: API.md §1 makes subgroups
communicators of their own (aborting the world leaves them alone), so a partner waiting
in a pair op for a rank that left the op order would otherwise wait out its deadline.

Only where the communicator has ``split`` (and ``--no-split`` is not given): the soak runs
without it on a build that has none.
"""

from __future__ import annotations

from typing import Any

from bench._chaos_ops import value

#: Every this many steps of the op stream (offset by 2 from the training steps) is a
#: subgroup op.
SPLIT_EVERY = 5


def pairs(world_size: int) -> list[list[int]]:
    """The groups every rank passes to ``split``: consecutive pairs, the last one alone if odd."""
    return [list(range(i, min(i + 2, world_size))) for i in range(0, world_size, 2)]


def available(comm: Any) -> bool:
    return hasattr(comm, "split")


class Subgroup:
    """This rank's pair of the world communicator of the moment (None before the first split)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.sub: Any = None
        self.group: list[int] = []  # world ranks of the pair
        self.made = self.ops = 0

    async def remake(self, comm: Any, check: list[str]) -> None:
        """Close the old pair, split ``comm`` into new ones (a collective on ``comm``)."""
        await self.close()
        if not (self.enabled and available(comm)):
            return
        groups = pairs(comm.world_size)
        sub = await comm.split(groups)
        self.group = next(g for g in groups if comm.rank in g)
        if sub is None:
            check.append(f"split({groups}) gave rank {comm.rank} no group")
            return
        if (sub.rank, sub.world_size) != (self.group.index(comm.rank), len(self.group)):
            check.append(
                f"split({groups}): rank {comm.rank} got rank {sub.rank} of {sub.world_size}"
            )
        self.sub = sub
        self.made += 1

    async def exercise(self, k: int, deadline: float, check: list[str]) -> bool:
        """One all-reduce on this rank's pair, checked; False when there is no pair."""
        import torch

        if self.sub is None:
            return False
        mine = value(k, self.group[self.sub.rank])
        t = torch.full((5,), mine, dtype=torch.float64)
        await self.sub.all_reduce(t, timeout=deadline)
        want = sum(value(k, q) for q in self.group)
        if not bool((t == want).all()):
            check.append(f"step {k}: subgroup {self.group} all_reduce {t[0].item()} != {want}")
        self.ops += 1
        return True

    def abort(self, reason: str) -> None:
        """Abort the pair (its other member hears it as news), after a failure elsewhere."""
        if self.sub is not None:
            self.sub.abort(reason)

    def world_ranks(self, exc: BaseException) -> list[int]:
        """The world ranks of the pair members that a subgroup failure names."""
        return [
            self.group[q] for q in getattr(exc, "ranks", None) or () if 0 <= q < len(self.group)
        ]

    async def close(self) -> None:
        import asynccoll as ac

        sub, self.sub = self.sub, None
        if sub is not None:
            try:
                await sub.close()
            except ac.AsyncCollError:  # (close is idempotent and bounded; nothing to add)
                pass
