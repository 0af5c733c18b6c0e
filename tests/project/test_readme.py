"""Every self-contained README snippet runs, pasted into a script as is.

Convention: a ```python block of README.md that contains ``if __name__ == "__main__":``
is a complete script; this test writes it to a file and runs it with this Python
(the repository on ``PYTHONPATH``, a deadline, no GPU needed unless the block skips
itself). Fragments without that guard (API tours, torchrun-launched examples) are
not run. To have a new snippet tested, make it a complete script with the guard;
a snippet that calls ``run_ranks`` must have it (the ranks are new processes that
re-import the script).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT, child_env

GUARD = 'if __name__ == "__main__":'
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)
SCRIPTS = [b for b in BLOCKS if GUARD in b]


def test_run_ranks_snippets_are_guarded_scripts() -> None:
    using = [b for b in BLOCKS if "run_ranks(" in b]
    assert using, "README has no run_ranks example"
    for block in using:
        assert GUARD in block, (
            f"a run_ranks snippet fails when pasted into a script without {GUARD!r}:\n{block}"
        )
    assert SCRIPTS


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("index", range(len(SCRIPTS)))
def test_readme_script_runs(index: int, tmp_path: Path) -> None:
    script = tmp_path / f"readme_snippet_{index}.py"
    script.write_text(SCRIPTS[index])
    env = child_env()
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, (
        f"snippet {index} failed:\n{SCRIPTS[index]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    )
