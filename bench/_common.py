"""Helpers shared by the benchmarks: rank spawning, percentiles, progress, the floor bridges.

The *floor* is the thinnest possible awaitable bridge over a torch Gloo Work: one
waiter thread calls ``work.wait()`` and then hands the result to the event loop
(``loop.call_soon_threadsafe(fut.set_result, None)`` on asyncio/uvloop,
``token.run_sync_soon(event.set)`` on trio). Any awaitable collective on top of
Gloo pays at least this thread-to-loop hand-off; asynccoll's own cost is what it
adds on top.
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

#: Above this 1-minute load average a figure is not a verdict (issue 20).
QUIET_LOAD = 1.5


def machine() -> dict[str, Any]:
    """What every result records: the load average (1, 5, 15 min) and the CPU count."""
    return {"loadavg": list(os.getloadavg()), "cpus": os.cpu_count()}


def quiet(*snapshots: dict[str, Any]) -> bool:
    """True if the 1-minute load average was at most ``QUIET_LOAD`` in every snapshot."""
    return all(s["loadavg"][0] <= QUIET_LOAD for s in snapshots)


def store_server(timeout: float = 120.0) -> Any:
    """A TCPStore server on a port the OS picks; the ranks join it as clients (``.port``).

    Keep it referenced until the ranks are done. Picking a free port first and letting
    rank 0 bind it later raced with every other socket on the machine: the bench smoke
    test (five benches side by side, ~30 processes) failed about one run in eight when a
    rank connected to a port something else had taken meanwhile ("Connection reset by
    peer").
    """
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank, lower); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def orders(modes: Sequence[str], n: int, seed: int) -> list[list[str]]:
    """``n`` shuffled orders of ``modes``, the same on every rank (same ``seed``).

    Ranks run in lockstep, so an op's latency includes how late the peer issues it,
    i.e. the peer's completion cost of the op before; shuffling gives every mode the
    same mix of predecessors (a fixed rotation does not: in A B C / B C A / C A B,
    B follows A two times in three)."""
    import random

    rng = random.Random(seed)
    return [rng.sample(list(modes), len(modes)) for _ in range(n)]


def progress(msg: str) -> None:
    """One line of progress on stderr (the results go to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_loop(loop: str, main: Callable[[], Any]) -> Any:
    """Run the coroutine function ``main`` on ``loop`` ("asyncio", "uvloop" or "trio")."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main())
    if loop == "trio":
        import trio

        return trio.run(main)
    return asyncio.run(main())


async def last_waiter_after(
    awaitables: Iterable[Awaitable[Any]], abort: Callable[[], None], caught: type[BaseException]
) -> float:
    """The abort benches' measuring loop: one task awaits each of ``awaitables``; once
    all are parked, ``abort()`` is called on the loop; the seconds from that call to the
    last task's ``except caught``.

    The timed window starts after a full ``gc.collect()``: the rounds' own garbage
    (a thousand Works, tasks and tracebacks each) otherwise sets off a full collection
    of the process's heap, torch's included (~100 ms), inside one window in five or so.
    ``abort`` measures its own call if the caller wants that figure.
    """
    ends: list[float] = []

    async def waiter(awaitable: Awaitable[Any]) -> None:
        try:
            await awaitable
        except caught:
            ends.append(time.perf_counter())

    tasks = [asyncio.ensure_future(waiter(a)) for a in awaitables]
    await asyncio.sleep(0.05)  # every task is parked on its awaitable
    gc.collect()
    t0 = time.perf_counter()
    abort()
    await asyncio.gather(*tasks)
    assert len(ends) == len(tasks), (len(ends), len(tasks))
    return max(ends) - t0


def write_json(res: Any, path: str | Path) -> Path:
    """Write a bench's results to ``path`` (folders made as needed) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))
    print(f"wrote {path}")
    return path


def _child(target: Callable[..., Any], rank: int, args: tuple[Any, ...], conn: Any) -> None:
    try:
        conn.send(("ok", target(rank, *args)))
    except BaseException as exc:  # report to the parent whatever it is, then exit non-zero
        import traceback

        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from exc


def spawn(
    target: Callable[..., Any], args: tuple[Any, ...], world_size: int = 2, limit: float = 900.0
) -> list[Any]:
    """Run ``target(rank, *args)`` for every rank; their results by rank.

    Rank 0 runs in this process (one interpreter fewer to start), the others in
    spawned processes. A watchdog ends this process if another rank fails or the
    whole run exceeds ``limit`` seconds, so a lost peer never leaves rank 0 hanging.
    """
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for r in range(1, world_size):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(target, r, args, child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    results: dict[int, Any] = {}
    done = threading.Event()

    def watchdog() -> None:
        deadline = time.monotonic() + limit
        while not done.wait(0.2):
            for r, (conn, p) in enumerate(zip(pipes, procs), start=1):
                if r in results:
                    continue
                if conn.poll():
                    status, payload = conn.recv()
                    if status != "ok":
                        print(f"benchmark rank {r} failed:\n{payload}", file=sys.stderr, flush=True)
                        os._exit(1)
                    results[r] = payload
                elif not p.is_alive():
                    print(
                        f"benchmark rank {r} died (exit code {p.exitcode})",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(1)
            if time.monotonic() > deadline:
                print(f"benchmark did not finish in {limit:.0f} s", file=sys.stderr, flush=True)
                os._exit(1)

    dog = threading.Thread(target=watchdog, name="bench-watchdog", daemon=True)
    dog.start()
    try:
        results[0] = target(0, *args)
        while len(results) < world_size and dog.is_alive():
            time.sleep(0.05)
    finally:
        done.set()
        dog.join(5)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return [results[r] for r in range(world_size)]


class FloorBridge:
    """The floor: one waiter thread, ``work.wait()``, then one hand-off to the loop per op.

    ``submit(torch_work)`` returns an awaitable that completes on the calling loop
    once ``torch_work.wait()`` returned on the waiter thread. Nothing else: no
    batching, no error handling beyond what ``wait()`` raises (the waiter dies).
    ``all_reduce(t)`` issues on the bridge's own Gloo group (``group``): every
    compared mode gets a group of its own, so none profits from another's warm
    Gloo threads (a group used by two of three modes runs hotter than the third).
    """

    def __init__(self, loop: str, group: Any = None) -> None:
        self.group = group
        self._trio = loop == "trio"
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        if self._trio:
            import trio

            self._token = trio.lowlevel.current_trio_token()
            self._event_cls = trio.Event
            target = self._run_trio
        else:
            self._loop = asyncio.get_running_loop()
            target = self._run_asyncio
        self._thread = threading.Thread(target=target, name="floor-bridge", daemon=True)
        self._thread.start()

    def all_reduce(self, t: Any) -> Any:
        import torch.distributed as dist

        return self.submit(dist.all_reduce(t, group=self.group, async_op=True))

    def submit(self, torch_work: Any) -> Any:
        if self._trio:
            ev = self._event_cls()
            self._q.put((torch_work, ev))
            return ev.wait()
        fut = self._loop.create_future()
        self._q.put((torch_work, fut))
        return fut

    def _run_asyncio(self) -> None:
        get, hand = self._q.get, self._loop.call_soon_threadsafe
        while True:
            tw, fut = get()
            if tw is None:
                return
            tw.wait()
            hand(fut.set_result, None)
            del tw, fut

    def _run_trio(self) -> None:
        get, hand = self._q.get, self._token.run_sync_soon
        while True:
            tw, ev = get()
            if tw is None:
                return
            tw.wait()
            hand(ev.set)
            del tw, ev

    def close(self) -> None:
        self._q.put((None, None))
        self._thread.join(5)


class Runtime:
    """The little that differs between asyncio/uvloop and trio in these benchmarks."""

    def __init__(self, loop: str) -> None:
        self.name = loop
        if loop == "trio":
            import trio

            self._sleep = trio.sleep
        else:
            self._sleep = asyncio.sleep

    async def sleep(self, seconds: float) -> None:
        await self._sleep(seconds)

    async def with_heartbeat(
        self, body: Callable[[], Any], period: float = 1e-3
    ) -> tuple[float, list[float]]:
        """Run ``await body()`` while a task asks to wake every ``period`` s and records
        how late it wakes (perf_counter: uvloop's clock has 1 ms resolution).
        Returns (body's wall time, the lags)."""
        lags: list[float] = []
        stop = [False]
        clock, sleep = time.perf_counter, self._sleep

        async def heartbeat() -> None:
            while not stop[0]:
                t0 = clock()
                await sleep(period)
                lags.append(max(0.0, clock() - t0 - period))

        async def measured() -> float:
            await sleep(0.01)
            t0 = clock()
            await body()
            wall = clock() - t0
            await sleep(0.005)
            stop[0] = True
            return wall

        if self.name == "trio":
            import trio

            result: list[float] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(heartbeat)

                async def run() -> None:
                    result.append(await measured())

                nursery.start_soon(run)
            return result[0], lags
        task = asyncio.ensure_future(heartbeat())
        wall = await measured()
        await task
        return wall, lags
