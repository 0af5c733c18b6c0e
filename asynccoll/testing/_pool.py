"""The parent side: :class:`RankPool` (worker processes kept across runs) and :func:`run_ranks`.

A pool hosts one TCPStore server and ``world_size`` spawned workers (see ``_worker.py``).
Each run sends every worker the pickled ``fn``; the parent waits on the pipes and the
process sentinels until each rank has answered or died, or the timeout expires. Any
run that was not clean (a rank failed, was lost, timed out, or its communicator ended
aborted) replaces every worker before the next run.
"""

from __future__ import annotations

import inspect
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Iterable, Sequence

from .._base.errors import is_abort_error
from ._errors import RanksTimedOut, RemoteTraceback
from ._process import (
    DUMP_WAIT,
    FAILURE_GRACE,
    HOST,
    LOOPS,
    START_TIMEOUT,
    Outcome,
    Worker,
    exit_text,
    mp_context,
    outcome_from,
    stop_workers,
)


class RankPool:
    """``world_size`` worker processes kept alive across :func:`run_ranks` runs.

    Workers never fork the caller: with ``start_method="forkserver"`` (the default
    where available) they are forked from multiprocessing's clean fork-server
    process, which imported torch and asynccoll once, so a fresh worker costs tens
    of ms; ``"spawn"`` starts each from scratch (seconds). They share one TCPStore
    server hosted by this process. After a run that was not clean every worker is
    replaced by a fresh process. Use as a context manager or call :meth:`close`; a
    pool that is garbage-collected, or still open at interpreter exit, stops its
    workers then. Workers also exit by themselves if this process dies.
    """

    def __init__(self, world_size: int, *, start_method: str | None = None) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        import torch.distributed as dist

        self.world_size = world_size
        self._ctx = mp_context(start_method)
        self._server: dist.TCPStore | None = dist.TCPStore(
            HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self._port = self._server.port
        self._lock = threading.RLock()
        self._runs = 0
        self._closed = False
        # Mutated in place only: the finalizer holds this very list.
        self._workers: list[Worker] = []
        # Stops the workers on close(), when the pool is garbage-collected, or at exit.
        self._finalizer = weakref.finalize(self, stop_workers, self._workers)
        self._spawn()

    # ------------------------------------------------------------ processes
    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers, by rank."""
        return [w.pid for w in self._workers]

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called; a closed pool runs nothing more."""
        return self._closed

    def _spawn(self) -> None:
        self._workers[:] = [Worker(self._ctx, r, self._port) for r in range(self.world_size)]

    def _replace(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers.clear()
        if not self._closed:
            self._spawn()

    def _ensure_ready(self) -> None:
        if any(w.proc.exitcode is not None for w in self._workers):
            self._replace()
        deadline = time.monotonic() + START_TIMEOUT
        for w in self._workers:
            while not w.ready:
                left = deadline - time.monotonic()
                msg: Any = None
                if left > 0 and w.conn.poll(min(left, 0.1)):
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        w.proc.join(1)
                        msg = ("failed", exit_text(w.proc.exitcode))
                elif left <= 0 or w.proc.exitcode is not None:
                    why = (
                        f"no answer within {START_TIMEOUT:g} s"
                        if left <= 0
                        else exit_text(w.proc.exitcode)
                    )
                    msg = ("failed", why)
                if msg is None:
                    continue
                if msg[0] == "ready":
                    w.ready = True
                    w.start_time = msg[2]
                elif msg[0] == "failed":
                    self._replace()
                    raise RuntimeError(f"worker for rank {w.rank} failed to start: {msg[1]}")

    def close(self) -> None:
        """Stop every worker and the store server. Idempotent; no process is left behind."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._finalizer()
            self._server = None
            for key, pool in list(_DEFAULT_POOLS.items()):
                if pool is self:
                    del _DEFAULT_POOLS[key]

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pids={self.pids}"
        return f"<RankPool world_size={self.world_size} {state}>"

    # ------------------------------------------------------------------ runs
    def run(
        self,
        fn: Callable[..., Any],
        *,
        args: Sequence[Any] = (),
        backend: str | None = "gloo",
        timeout: float = 60.0,
        loop: str = "asyncio",
        init_timeout: float | None = None,
        lost: Iterable[int] = (),
    ) -> list[Any]:
        """Run ``fn`` on every rank of this pool; see :func:`run_ranks`."""
        lost_set = frozenset(lost)
        payload = _payload(fn, args, backend, self.world_size, timeout, init_timeout, loop)
        with self._lock:
            if self._closed:
                raise RuntimeError("this RankPool is closed")
            self._ensure_ready()
            self._runs += 1
            run_id = self._runs
            clean = False
            try:
                msg = ("run", run_id, list(sys.path), payload)
                for w in self._workers:
                    try:
                        w.conn.send(msg)
                    except OSError:
                        pass  # it died: seen by _collect
                outcomes, stuck = self._collect(run_id, timeout, lost_set)
                results, clean = self._conclude(outcomes, stuck, lost_set, timeout)
                return results
            finally:
                if not clean:
                    self._replace()

    def _collect(
        self, run_id: int, timeout: float, lost: frozenset[int]
    ) -> tuple[list[Outcome | None], list[int]]:
        """Wait for every non-lost rank's outcome; returns the outcomes and the ranks still running.

        The timeout counts from when every rank has unpickled the task (importing
        ``fn``'s module is not the test's time), or from now for a rank that never does.
        """
        outcomes: list[Outcome | None] = [None] * self.world_size
        pending = set(range(self.world_size))
        started: set[int] = set()
        limit = time.monotonic() + timeout
        all_started = False
        while True:
            self._drain(run_id, pending, outcomes, started)
            waiting = [r for r in pending if r not in lost]
            if not waiting:
                break
            now = time.monotonic()
            if not all_started and len(started) == self.world_size:
                all_started = True
                limit = now + timeout
            if any(
                o is not None and o.kind != "ok" for r, o in enumerate(outcomes) if r not in lost
            ):
                limit = min(limit, now + FAILURE_GRACE)
            if now >= limit:
                break
            objs: list[Any] = []
            for r in pending:
                objs += [self._workers[r].conn, self._workers[r].proc.sentinel]
            multiprocessing.connection.wait(objs, timeout=limit - now)
        return outcomes, sorted(r for r in pending if r not in lost)

    def _drain(
        self, run_id: int, pending: set[int], outcomes: list[Outcome | None], started: set[int]
    ) -> None:
        for r in sorted(pending):
            w = self._workers[r]
            try:
                while w.conn.poll():
                    msg = w.conn.recv()
                    if msg[0] == "started" and msg[1] == run_id:
                        started.add(r)
                    elif msg[0] == "result" and msg[1] == run_id:
                        outcomes[r] = outcome_from(msg)
                        pending.discard(r)
                        break
            except (EOFError, OSError):
                pass
            if r in pending and w.proc.exitcode is not None:
                pending.discard(r)
                outcomes[r] = Outcome(
                    "died",
                    error=RuntimeError(
                        f"rank {r} (pid {w.pid}) died unexpectedly: {exit_text(w.proc.exitcode)}"
                    ),
                    summary=f"rank {r}: died ({exit_text(w.proc.exitcode)})",
                )

    def _conclude(
        self, outcomes: list[Outcome | None], stuck: list[int], lost: frozenset[int], timeout: float
    ) -> tuple[list[Any], bool]:
        failures = [
            (r, o)
            for r, o in enumerate(outcomes)
            if o is not None and o.kind != "ok" and r not in lost
        ]
        stacks = self._dump_stacks(stuck) if stuck else {}
        if failures:
            # The root cause first: a rank whose error is only the news of another
            # rank's abort (a CommAborted, not its own op's timeout or mismatch)
            # yields to the rank that failed on its own.
            failures.sort(key=lambda f: (is_abort_error(f[1].error), f[0]))
            r, first = failures[0]
            others = [o.summary for rr, o in failures[1:]]
            others += [f"rank {s}: still running, killed after the failure" for s in stuck]
            text = first.text or first.summary
            if others:
                text += "\nOther ranks:\n" + "\n".join(f"  {line}" for line in others) + "\n"
            for s in stuck:
                text += f"\n--- stacks of rank {s} ---\n{stacks.get(s, '')}"
            exc = first.error
            assert exc is not None
            try:
                exc.rank = r  # type: ignore[attr-defined]
            except (
                AttributeError
            ):  # an exception type with __slots__: the rank stays in the traceback text
                pass
            raise exc from RemoteTraceback(text, rank=r)
        if stuck:
            parts = [
                f"ranks {stuck} still running after {timeout:g} s (run_ranks timeout); their stacks:"
            ]
            for s in stuck:
                parts.append(f"--- rank {s} (pid {self._workers[s].pid}) ---\n{stacks.get(s, '')}")
            message = "\n".join(parts)
            print(message, file=sys.stderr, flush=True)
            raise RanksTimedOut(message, ranks=stuck, stacks=stacks)
        results = [o.value if o is not None and o.kind == "ok" else None for o in outcomes]
        clean = not lost and all(
            o is not None and o.kind == "ok" and not o.aborted for o in outcomes
        )
        return results, clean

    def _dump_stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Asyncio task chains (via the pipe) and all threads' stacks (faulthandler, SIGUSR1)."""
        offsets = {}
        for r in ranks:
            w = self._workers[r]
            w.signal(signal.SIGCONT)
            offsets[r] = w.stack_size()
            try:
                w.conn.send(("dump",))
            except OSError:
                pass
            w.signal(signal.SIGUSR1)
        tasks: dict[int, str] = {}
        end = time.monotonic() + DUMP_WAIT
        while len(tasks) < len(ranks) and time.monotonic() < end:
            conns = {self._workers[r].conn: r for r in ranks if r not in tasks}
            for conn in multiprocessing.connection.wait(
                list(conns), timeout=end - time.monotonic()
            ):
                r = conns[conn]
                try:
                    msg = conn.recv()  # type: ignore[union-attr,call-arg]
                except (EOFError, OSError):
                    tasks[r] = "(no answer: the process is gone)\n"
                    continue
                if msg[0] == "stacks":
                    tasks[r] = str(msg[1])
        time.sleep(0.2)  # faulthandler writes from the signal handler, at once
        out = {}
        for r in ranks:
            w = self._workers[r]
            out[r] = (
                "asyncio tasks:\n"
                + tasks.get(r, "(no answer within the dump wait)\n")
                + "threads:\n"
                + (w.read_stacks(offsets[r]) or "(no dump)\n")
            )
        return out


def _payload(
    fn: Callable[..., Any],
    args: Sequence[Any],
    backend: str | None,
    world_size: int,
    timeout: float,
    init_timeout: float | None,
    loop: str,
) -> bytes:
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"fn must be an async def function, got {fn!r}")
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(
        sys.modules.get("__main__"), "__file__", None
    ):
        raise ValueError(
            "fn is defined in a __main__ that worker processes cannot import (stdin or -c); "
            "put it in a module or a script file"
        )
    task = dict(
        fn=fn,
        args=tuple(args),
        backend=backend,
        world_size=world_size,
        timeout=float(timeout),
        init_timeout=init_timeout,
        loop=loop,
    )
    try:
        return pickle.dumps(task)
    except Exception as exc:
        raise TypeError(
            f"fn and args must be picklable (fn a module-level function of an importable module): {exc}"
        ) from exc


_DEFAULT_POOLS: dict[int, RankPool] = {}
_DEFAULT_LOCK = threading.Lock()


def _default_pool(world_size: int) -> RankPool:
    with _DEFAULT_LOCK:
        pool = _DEFAULT_POOLS.get(world_size)
        if pool is None or pool.closed:
            pool = _DEFAULT_POOLS[world_size] = RankPool(world_size)
        return pool


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    backend: str | None = "gloo",
    timeout: float = 60,
    loop: str = "asyncio",
    *,
    args: Sequence[Any] = (),
    init_timeout: float | None = None,
    lost: Iterable[int] = (),
    pool: RankPool | None = None,
) -> list[Any]:
    """Run ``async def fn(comm, *args)`` on ``world_size`` ranks, each in its own process.

    Each rank builds ``comm = await ac.init(backend, rank=r, world_size=n, store=...)``
    on a store prefix unique to this run, awaits ``fn(comm, *args)`` on a fresh
    ``loop`` (``"asyncio"``, ``"uvloop"`` or ``"trio"``), then closes ``comm``. With
    ``backend=None`` no communicator is made: ``fn(ctx, *args)`` gets a
    :class:`RankContext`. Returns each rank's (picklable) return value, by rank.

    A rank's exception is re-raised here (its type when it unpickles, else
    ``RuntimeError``) with ``__cause__`` a :class:`RemoteTraceback` and ``.rank``;
    with several, the lowest rank's. Ranks still running after ``timeout`` seconds
    have their stacks printed and are killed: :class:`RanksTimedOut`. ``lost``:
    ranks expected to die or hang; the run ends when the others have finished, and
    their slots are ``None`` unless they returned. ``fn`` must be a module-level
    function of an importable module.
    """
    lost = tuple(lost)
    for r in lost:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
            raise ValueError(f"lost rank {r!r} is out of range for world_size {world_size}")
    if pool is None:
        _payload(fn, args, backend, world_size, timeout, init_timeout, loop)  # fail before spawning
        pool = _default_pool(world_size)
    elif pool.world_size != world_size:
        raise ValueError(f"pool has world_size {pool.world_size}, run_ranks was given {world_size}")
    return pool.run(
        fn,
        args=args,
        backend=backend,
        timeout=timeout,
        loop=loop,
        init_timeout=init_timeout,
        lost=lost,
    )
