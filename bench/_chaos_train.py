"""The chaos soak's training: a small model every member trains in step with ``GradSync``.

Every ``TRAIN_EVERY``-th step of the op stream (and the first after each membership
change) is a training step: each rank takes its shard of a global batch that depends
only on the training step, backward issues the gradient buckets' all-reduces
(``GradSync``), and SGD with momentum steps. The model and the optimizer's state travel
to replacements with ``broadcast_state``, as ``examples/elastic.py`` sends them.

What is checked (``bench/_chaos_ranks.py`` calls these): before a state sync, the members
that hold a model agree on it (the same training step means bit-equal parameters and
momentum; a failure in the middle of a step may leave some one step ahead, no more);
after the sync, and again after the first training step on the new communicator, every
rank's parameters and momentum are bit-equal (``in_step``).
"""

from __future__ import annotations

import hashlib
from typing import Any

#: Every this many steps of the op stream is a training step.
TRAIN_EVERY = 5
#: The global batch: divisible by every world size up to 4.
BATCH = 24
FEATURES = 16


class Trainer:
    """This rank's model, optimizer and ``GradSync`` on the communicator of the moment."""

    def __init__(self, seed: int, gen: int) -> None:
        import torch

        self.seed, self.gen = seed, gen
        init = torch.Generator().manual_seed(seed * 1009 + gen)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 1),
        )
        with torch.no_grad():  # the same start on every first member of a generation
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=init) * 0.3)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.02, momentum=0.9)
        self.step = 0  # training steps done (the same on every rank in step)
        self.sync: Any = None

    def attach(self, comm: Any) -> None:
        """Train on ``comm`` from now on (after every membership change): a new ``GradSync``.
        Small buckets, so that a step is several all-reduces issued during backward."""
        import asynccoll as ac

        self.detach()
        self.sync = ac.GradSync(comm, self.model, bucket_mb=0.004, first_bucket_mb=0.002)

    def detach(self) -> None:
        """Drop the communicator (it failed or was replaced) and any half-done step's gradients."""
        if self.sync is not None:
            self.sync.close()
            self.sync = None
        self.opt.zero_grad(set_to_none=True)

    def batch(self, rank: int, world_size: int) -> tuple[Any, Any]:
        """This rank's shard of the training step's global batch (the same at any world size)."""
        import torch

        data = torch.Generator().manual_seed(self.seed * 100_003 + self.gen * 1009 + self.step)
        x = torch.randn(BATCH, FEATURES, generator=data)
        y = torch.sin(x[:, :1] * 2) + x[:, 1:2] * x[:, 2:3]
        return x[rank::world_size], y[rank::world_size]

    async def train(self, comm: Any) -> float:
        """One training step on ``comm``; the loss on this rank's shard."""
        import torch

        x, y = self.batch(comm.rank, comm.world_size)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()  # the buckets' all-reduces are issued as their gradients are ready
        await self.sync.wait()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return float(loss.item())

    def digest(self) -> str:
        """A hash of the parameters and the momentum buffers, bit for bit."""
        h = hashlib.sha256()
        for p in self.model.parameters():
            h.update(p.detach().numpy().tobytes())
            buf = self.opt.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                h.update(buf.numpy().tobytes())
        return h.hexdigest()[:16]

    def held(self) -> tuple[int, str]:
        """What a member holds, as the state sync compares it."""
        return self.step, self.digest()

    def snapshot(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step}

    def load(self, snap: dict[str, Any]) -> None:
        self.model.load_state_dict(snap["model"])
        self.opt.load_state_dict(snap["opt"])
        self.step = int(snap["step"])

    def close(self) -> None:
        self.detach()


def pick_source(held: list[tuple[int, str] | None], check: list[str]) -> int | None:
    """The rank whose model everyone takes at a state sync: the lowest of those furthest on.

    ``held[q]``: rank ``q``'s (training step, digest), None for a rank with no model yet (a
    replacement). Violations go to ``check``: two holders at the same step with different
    digests (they trained out of step), or holders more than one step apart (a step that
    failed on some ranks and completed on others leaves them one apart, never more).
    """
    holders = [(q, h) for q, h in enumerate(held) if h is not None]
    if not holders:
        return None
    by_step: dict[int, set[str]] = {}
    for _, (step, digest) in holders:
        by_step.setdefault(step, set()).add(digest)
    for step, digests in sorted(by_step.items()):
        if len(digests) > 1:
            check.append(f"members at training step {step} hold different parameters: {held}")
    if max(by_step) - min(by_step) > 1:
        check.append(f"members more than one training step apart: {held}")
    top = max(by_step)
    return min(q for q, (step, _) in holders if step == top)


async def in_step(
    comm: Any, trainer: Trainer, deadline: float, check: list[str], when: str
) -> bool:
    """Whether every rank of ``comm`` holds bit-equal parameters and momentum at the same
    training step (a collective); a violation in ``check`` if not."""
    everyone = await comm.all_gather_object(trainer.held(), timeout=deadline)
    if len({tuple(h) for h in everyone}) == 1:
        return True
    check.append(f"parameters not bit-equal {when}: (step, digest) by rank {everyone}")
    return False
