"""The parent's handle on each worker process of a :class:`~._pool.RankPool`: its pipe, its stacks, its outcome.

Each worker is a ``multiprocessing`` process running ``_worker.main`` (forked from the
fork server, which imported torch and asynccoll once). The parent talks to it over a
duplex pipe; SIGUSR1 makes it dump every thread's stack into its stack file.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
from typing import Any, Iterator

from . import _worker

HOST = "127.0.0.1"
LOOPS = ("asyncio", "uvloop", "trio")
#: Once a rank has failed, how long the others get to finish before they are killed.
FAILURE_GRACE = 3.0
#: How long the parent waits for stack dumps from stuck ranks.
DUMP_WAIT = 1.0
START_TIMEOUT = 120.0


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal_name(-code)}"
    return f"exited with code {code}"


@contextlib.contextmanager
def main_without_missing_file() -> Iterator[None]:
    """Hide ``__main__.__file__`` from spawn when it names no file (``python - <<EOF``).

    Spawn re-runs the parent's main script in each child; for a main read from stdin
    that path does not exist and the child would die before running anything.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    hide = (
        main is not None
        and getattr(main, "__spec__", None) is None
        and isinstance(path, str)
        and not os.path.exists(path)
    )
    if hide:
        del main.__file__  # type: ignore[union-attr]
    try:
        yield
    finally:
        if hide:
            main.__file__ = path  # type: ignore[union-attr]


def mp_context(method: str | None) -> Any:
    """``forkserver`` by default: each worker is forked from a clean server process that
    imported torch and asynccoll once (tens of ms instead of seconds per worker), never
    from the caller's process. ``spawn`` where forkserver is unavailable."""
    if method is None:
        method = (
            "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        )
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {method!r}")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["asynccoll.testing._worker", "asynccoll"])
    return ctx


class Worker:
    """One worker process, its pipe and its stack-dump file."""

    def __init__(self, ctx: Any, rank: int, port: int) -> None:
        self.rank = rank
        fd, self.stack_path = tempfile.mkstemp(prefix=f"asynccoll-rank{rank}-", suffix=".stacks")
        os.close(fd)
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker.main,
            args=(rank, child, HOST, port, os.getpid(), self.stack_path),
            name=f"asynccoll-rank{rank}",
            daemon=True,
        )
        with main_without_missing_file():
            self.proc.start()
        child.close()
        self.ready = False
        self.start_time: float | None = None

    @property
    def pid(self) -> int:
        pid = self.proc.pid
        assert pid is not None  # started in __init__
        return int(pid)

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stack_size(self) -> int:
        try:
            return os.path.getsize(self.stack_path)
        except OSError:
            return 0

    def read_stacks(self, offset: int) -> str:
        try:
            with open(self.stack_path, "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGCONT + SIGKILL, reap, release the pipe and the stack file."""
        if self.proc.exitcode is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
        self.proc.join(10)
        self.conn.close()
        try:
            os.unlink(self.stack_path)
        except OSError:
            pass

    def stop(self) -> None:
        """Ask the worker to exit (closing the pipe is enough); kill it if it lingers."""
        try:
            self.conn.send(("exit",))
        except OSError:  # the pipe is closed: the worker is gone already
            pass
        self.proc.join(2)
        self.kill()


class Outcome:
    __slots__ = ("kind", "value", "error", "text", "summary", "aborted")

    def __init__(
        self,
        kind: str,
        value: Any = None,
        error: BaseException | None = None,
        text: str = "",
        summary: str = "",
        aborted: bool = False,
    ) -> None:
        self.kind = kind  # "ok" | "err" | "died"
        self.value = value
        self.error = error
        self.text = text
        self.summary = summary
        self.aborted = aborted


def outcome_from(msg: tuple[Any, ...]) -> Outcome:
    if msg[2] == "ok":
        return Outcome("ok", value=pickle.loads(msg[3]), aborted=msg[4])
    _, _, _, blob, name, message, text, summary, aborted = msg
    error: BaseException | None = None
    if blob is not None:
        try:
            error = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - any unpickling failure: the message and traceback text remain
            error = None
    if not isinstance(error, BaseException):
        error = RuntimeError(f"{name}: {message}")
    return Outcome("err", error=error, text=text, summary=summary, aborted=aborted)


def stop_workers(workers: list[Worker]) -> None:
    for w in workers:
        try:
            w.conn.send(("exit",))
        except OSError:  # the pipe is closed: the worker is gone already
            pass
    for w in workers:
        w.stop()
    workers.clear()
