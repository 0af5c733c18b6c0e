"""Liveness at scale: store requests per second and detection time against the member count.

    python -m bench.liveness_scale [--members 16 64 256 512] [--processes 4] [--interval 0.5]
                                   [--json bench/results/liveness_scale.json]

Hundreds of simulated members of one communicator run in a few processes
(``--processes``, members spread over them round-robin, so neighbours in the ring
live in different processes), against one real TCPStore hosted here; one more
member runs alone in a *victim* process. Every member is a real
``asynccoll._faults.liveness.Liveness`` with heartbeat detection on (NCCL's
default), as a communicator of that size would create; each process counts the
requests its members make to the store (a counting wrapper around its TCPStore
client: one method call = one request).

For each member count:

* **steady**: ``--steady`` seconds of beating; requests per second on the
  store (all processes together), requests per member and beat, and the beat
  interval the members actually achieved;
* **detection**: the victim process is SIGKILLed; the time from the kill until
  every member has received its ``PeerFailure`` (median and worst member), and
  whether any member named a rank other than the victim (a false positive).
  The victim's watchers (``WATCH`` = 3 members) detect it from its silent
  heartbeat; the first to do so publishes the abort as its communicator would
  (``publish_abort``), and the others get it as news: ``detect_first_s`` is that
  first detection, the worst member the last one to hear. ``detected``/``of``
  says how many had it when the bench stopped waiting (up to 30 s + 10 beats
  for all of them).

A plot (``<json stem>.png``) shows both against the member count, with the
O(n^2) line of the previous design (every rank read every other rank's counter
each beat: n(n-1)/interval reads per second) for reference. Every figure
records the load average; one taken at load > 1.5 is not a verdict.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HOST = "127.0.0.1"


def _counting_store(port: int) -> Any:
    import torch.distributed as dist

    class Counting(dist.Store):  # type: ignore[misc]
        """A TCPStore client that counts its requests (one method call = one request)."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner
            self.requests = 0
            self._lock = threading.Lock()

        def _n(self) -> None:
            with self._lock:
                self.requests += 1

        def set(self, key: str, value: Any) -> None:
            self._n()
            self.inner.set(key, value)

        def get(self, key: str) -> bytes:
            self._n()
            return bytes(self.inner.get(key))

        def add(self, key: str, value: int) -> int:
            self._n()
            return int(self.inner.add(key, value))

        def check(self, keys: list[str]) -> bool:
            self._n()
            return bool(self.inner.check(keys))

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            self._n()
            return bytes(self.inner.compare_set(key, expected, desired))

        def multi_get(self, keys: list[str]) -> list[bytes]:
            self._n()
            return list(self.inner.multi_get(keys))

        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            self._n()
            self.inner.multi_set(keys, values)

        def delete_key(self, key: str) -> bool:
            self._n()
            return bool(self.inner.delete_key(key))

        def num_keys(self) -> int:
            return int(self.inner.num_keys())

        def queue_push(
            self, key: str, value: Any
        ) -> None:  # (the previous design's census inboxes)
            self._n()
            self.inner.queue_push(key, value)

        def queue_pop(self, key: str, block: bool = True) -> bytes:
            self._n()
            return bytes(self.inner.queue_pop(key, block))

        def queue_len(self, key: str) -> int:
            self._n()
            return int(self.inner.queue_len(key))

    client = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=120))
    return Counting(client)


def _members(ranks: list[int], n: int, port: int, prefix: str, interval: float, conn: Any) -> None:
    """One process: members ``ranks`` of an ``n``-rank communicator."""
    import torch.distributed as dist

    from asynccoll._faults.liveness import Liveness

    counting = _counting_store(port)
    store = dist.PrefixStore(prefix, counting)
    failures: dict[int, tuple[float, list[int]]] = {}
    lock = threading.Lock()

    by_rank: dict[int, Liveness] = {}

    def on_failure(rank: int) -> Any:
        def record(exc: BaseException) -> None:
            with lock:
                failures.setdefault(rank, (time.time(), list(getattr(exc, "ranks", ()) or ())))
            # What a communicator does when it aborts (``parts.aborted``): tell the peers.
            # The watchers' news is how the other members learn of the death.
            by_rank[rank].publish_abort(exc)

        return record

    members = [Liveness(store, r, n, interval=interval, detect=True) for r in ranks]
    by_rank.update(zip(ranks, members))
    for r, m in zip(ranks, members):
        m.publish()
        m.start(on_failure(r))
    conn.send(("started", os.getpid()))
    while True:
        cmd = conn.recv()
        if cmd == "count":
            beats = sum(int(store.add(f"hb/{r}", 0)) for r in ranks)
            conn.send(("count", counting.requests - len(ranks), beats, time.monotonic()))
            counting.requests -= 0
        elif cmd == "failures":
            with lock:
                conn.send(("failures", dict(failures)))
        elif cmd == "stop":
            for m in members:
                m.stop()
            time.sleep(2 * interval)
            conn.send(("stopped",))
            return


def _victim(rank: int, n: int, port: int, prefix: str, interval: float, conn: Any) -> None:
    _members([rank], n, port, prefix, interval, conn)


def one_size(
    ctx: Any, port: int, n: int, processes: int, interval: float, steady: float
) -> dict[str, Any]:
    prefix = f"scale/{n}/{time.monotonic_ns()}"
    victim = n // 2
    others = [r for r in range(n) if r != victim]
    groups = [others[i::processes] for i in range(processes)]
    procs, conns = [], []
    for ranks in [*groups, [victim]]:
        parent, child = ctx.Pipe()
        p = ctx.Process(
            target=_members, args=(ranks, n, port, prefix, interval, child), daemon=True
        )
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    pids = [c.recv()[1] for c in conns]
    load = os.getloadavg()[0]
    time.sleep(max(3 * interval, 1.0))  # past the start-up requests

    def count() -> tuple[int, int, float]:
        for c in conns:
            c.send("count")
        replies = [c.recv() for c in conns]
        return sum(r[1] for r in replies), sum(r[2] for r in replies), time.monotonic()

    req0, beats0, t0 = count()
    time.sleep(steady)
    req1, beats1, t1 = count()
    # (count() itself made n adds: one per member, not part of the beats)
    requests = req1 - req0 - n
    beats = beats1 - beats0
    row: dict[str, Any] = {
        "members": n,
        "processes": processes + 1,
        "interval_s": interval,
        "loadavg": load,
        "requests_per_s": requests / (t1 - t0),
        "requests_per_member_beat": requests / max(beats, 1),
        "beat_interval_achieved_s": (t1 - t0) * n / max(beats, 1),
        "previous_design_reads_per_s": n * (n - 1) / interval,
    }
    killed_at = time.time()
    os.kill(pids[-1], signal.SIGKILL)
    procs[-1].join(10)
    deadline = time.monotonic() + 30 + 10 * interval
    got: dict[int, tuple[float, list[int]]] = {}
    while time.monotonic() < deadline:
        got = {}
        for c in conns[:-1]:
            c.send("failures")
            got.update(c.recv()[1])
        if len(got) >= n - 1:
            break
        time.sleep(0.05)
    delays = sorted(t - killed_at for t, _ in got.values())
    row.update(
        detected=len(got),
        of=n - 1,
        detect_first_s=delays[0] if delays else None,
        detect_median_s=statistics.median(delays) if delays else None,
        detect_worst_s=delays[-1] if delays else None,
        false_positive=sorted({r for _, ranks in got.values() for r in ranks if r != victim}),
    )
    for c in conns[:-1]:
        c.send("stop")
    for c in conns[:-1]:
        try:
            c.recv()
        except EOFError:
            pass
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    return row


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["members"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(ns, [r["requests_per_s"] for r in rows], "o-", label="asynccoll (measured)")
    a.plot(
        ns,
        [r["previous_design_reads_per_s"] for r in rows],
        "--",
        color="tab:red",
        label="previous design: n(n-1)/interval reads",
    )
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("members (ranks)")
    a.set_ylabel("store requests per second")
    a.set_title(f"heartbeat traffic, interval {rows[0]['interval_s']:g} s")
    a.grid(True, which="both", alpha=0.3)
    a.legend(fontsize=8)
    b.plot(ns, [r["detect_median_s"] for r in rows], "o-", label="median member")
    b.plot(ns, [r["detect_worst_s"] for r in rows], "s--", label="last member")
    b.axhline(3 * rows[0]["interval_s"], color="grey", lw=0.8, label="3 x interval (the bound)")
    b.set_xscale("log", base=2)
    b.set_xlabel("members (ranks)")
    b.set_ylabel("SIGKILL -> PeerFailure (s)")
    b.set_title("detection of one dead member")
    b.grid(True, which="both", alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(members: list[int], processes: int, interval: float, steady: float) -> dict[str, Any]:
    import torch.distributed as dist

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["asynccoll", "torch"])
    server = dist.TCPStore(
        HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    res: dict[str, Any] = {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "rows": []}
    for n in members:
        row = one_size(ctx, server.port, n, processes, interval, steady)
        print(
            f"{n:>5} members: {row['requests_per_s']:9.0f} req/s ({row['requests_per_member_beat']:.2f} per member "
            f"and beat, beat every {row['beat_interval_achieved_s']:.2f} s; previous design "
            f"{row['previous_design_reads_per_s']:.0f} reads/s), detected by {row['detected']}/{row['of']} in "
            f"{row['detect_median_s'] or float('nan'):.2f} s median, {row['detect_worst_s'] or float('nan'):.2f} s "
            f"worst (the first {row['detect_first_s'] or float('nan'):.2f} s), false positives {row['false_positive']}, load {row['loadavg']:.2f}",
            flush=True,
        )
        res["rows"].append(row)
    res["loadavg_end"] = os.getloadavg()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--members", type=int, nargs="+", default=[16, 64, 256, 512])
    ap.add_argument(
        "--processes", type=int, default=4, help="processes holding the members (plus the victim)"
    )
    ap.add_argument("--interval", type=float, default=0.5, help="heartbeat interval, seconds")
    ap.add_argument(
        "--steady", type=float, default=5.0, help="seconds of steady beating measured per size"
    )
    ap.add_argument("--json", default="bench/results/liveness_scale.json")
    args = ap.parse_args(argv)
    res = run(args.members, args.processes, args.interval, args.steady)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))
    png = plot(res["rows"], path.with_suffix(".png"))
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
