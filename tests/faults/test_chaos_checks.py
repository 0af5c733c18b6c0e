"""The chaos soak's own checks, alone: that they see what they are there to see.

The soak (``tests/faults/test_chaos.py``) proves only that no violation occurred; these
pin that a violation would be reported: parameters one ulp apart on one rank, members
out of step at a state sync, the subgroups every rank passes to ``split``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asynccoll.testing import run_ranks
from bench._chaos_split import pairs
from bench._chaos_train import Trainer, in_step, pick_source


async def _train_then_check(comm: Any, nudge: bool) -> tuple[bool, list[str], int]:
    trainer = Trainer(seed=3, gen=1)
    trainer.attach(comm)
    for _ in range(3):
        await trainer.train(comm)
    if nudge and comm.rank == 1:  # one parameter one ulp off, on one rank
        with torch.no_grad():
            p = next(trainer.model.parameters())
            p[0, 0] = torch.nextafter(p[0, 0], torch.tensor(float("inf")))
    errors: list[str] = []
    ok = await in_step(comm, trainer, 30.0, errors, "in the test")
    trainer.close()
    return ok, errors, trainer.step


@pytest.mark.timeout(120)
def test_ranks_that_train_with_gradsync_stay_bit_equal() -> None:
    results = run_ranks(_train_then_check, world_size=2, timeout=90, args=(False,))
    assert [r[:2] for r in results] == [(True, [])] * 2, results
    assert [r[2] for r in results] == [3, 3]


@pytest.mark.timeout(120)
def test_a_parameter_one_ulp_off_is_a_violation_on_every_rank() -> None:
    results = run_ranks(_train_then_check, world_size=2, timeout=90, args=(True,))
    for ok, errors, _ in results:
        assert not ok and len(errors) == 1 and "not bit-equal in the test" in errors[0], results


@pytest.mark.timeout(10)
def test_the_state_sync_takes_the_model_furthest_on_and_flags_divergence() -> None:
    check: list[str] = []
    assert pick_source([None, (4, "a"), (5, "b"), (5, "b")], check) == 2
    assert pick_source([(4, "a"), None, (4, "a")], check) == 0
    assert pick_source([None, None], check) is None
    assert check == []  # a step that completed on some ranks only: one apart is no violation
    pick_source([(4, "a"), (4, "b")], check)
    assert len(check) == 1 and "different parameters" in check[0]
    check.clear()
    pick_source([(3, "a"), (5, "b")], check)
    assert len(check) == 1 and "more than one training step apart" in check[0]


@pytest.mark.timeout(10)
def test_the_subgroups_are_consecutive_pairs() -> None:
    assert pairs(4) == [[0, 1], [2, 3]]
    assert pairs(3) == [[0, 1], [2]]
    assert pairs(1) == [[0]]
