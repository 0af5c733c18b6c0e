"""Per-file line coverage of the GPU path by the CPU suite (``make coverage``).

    python -m tests.support.covered REPORT.json [MINIMUM]

Reads a coverage.py JSON report, prints every file of ``asynccoll/_backends/nccl/`` and
``streams/`` with its line coverage, and exits 1 when one is below MINIMUM (default 90).
"""

from __future__ import annotations

import json
import sys

PACKAGES = ("asynccoll/_backends/nccl/", "streams/")


def main(argv: list[str]) -> int:
    path = argv[0]
    minimum = float(argv[1]) if len(argv) > 1 else 90.0
    with open(path) as f:
        files = json.load(f)["files"]
    low = []
    print(f"{'file':45s} {'lines':>6s} {'missed':>6s} {'cover':>6s}")
    for name in sorted(files):
        if not name.startswith(PACKAGES):
            continue
        s = files[name]["summary"]
        pct = float(s["percent_covered"])
        print(f"{name:45s} {s['num_statements']:6d} {s['missing_lines']:6d} {pct:5.1f}%")
        if pct < minimum:
            low.append(name)
    if low:
        print(f"below {minimum:.0f} %: {', '.join(low)}")
        return 1
    print(f"every file at {minimum:.0f} % or more")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
