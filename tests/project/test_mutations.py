"""The deliberate breakages of ``make mutations`` still apply: each one's source text is
found exactly once, and each test it names exists. (Running them takes minutes; this
check takes none, so a reformat or a rename cannot silently retire a mutation.)"""

from __future__ import annotations

import ast

import pytest

from tests.support import paths
from tests.support.mutations import MUTATIONS, Mutation


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_still_applies(mutation: Mutation) -> None:
    source = (paths.ROOT / mutation.path).read_text()
    assert source.count(mutation.old) == 1, (
        f"{mutation.path}: {mutation.old!r} no longer found once"
    )
    for test in mutation.tests:
        file, _, name = test.partition("::")
        tree = ast.parse((paths.ROOT / file).read_text())
        if name:
            defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in defined, f"{test}: no such test"
