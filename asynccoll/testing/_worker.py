"""The rank side of :func:`run_ranks`: a long-lived worker process that runs one task at a time.

A worker imports torch and asynccoll once, connects a client to its pool's TCPStore,
then loops: receive a task, run ``fn`` on a fresh event loop, send back the value or
the exception. A reader thread owns the pipe's receiving side, so the parent can ask
for the asyncio task stacks of a rank whose loop is stuck; SIGUSR1 dumps every
thread's stack to a file (faulthandler, works even if the GIL is held). The worker
exits by itself when its parent goes away.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import faulthandler
import importlib
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import anyio

# The loop running the current task, for the task-stack dump (read from another thread).
_current_loop: asyncio.AbstractEventLoop | None = None


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What ``fn`` gets instead of a communicator when ``run_ranks(backend=None)``.

    ``store`` is a fresh ``torch.distributed.PrefixStore`` shared by the ranks of this
    run only: pass it to ``ac.init(store=...)`` (several times for several
    communicators).
    """

    rank: int
    world_size: int
    store: Any
    master_addr: str = "127.0.0.1"
    timeout: float = 60.0


class _NoWaitExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor: closing the loop does not wait for stuck threads."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=cancel_futures)


def format_tasks(loop: asyncio.AbstractEventLoop | None) -> str:
    """The await chain of every task of ``loop`` (callable from any thread)."""
    if loop is None or loop.is_closed():
        return "(no event loop running)\n"
    try:
        tasks = list(asyncio.all_tasks(loop))
    except Exception as exc:  # racing the loop thread
        return f"(could not list tasks: {exc!r})\n"
    lines = []
    for task in tasks:
        lines.append(f"Task {task.get_name()!r}:")
        obj: Any = task.get_coro()
        depth = 0
        while obj is not None and depth < 100:
            depth += 1
            frame = None
            for attr in ("cr_frame", "gi_frame", "ag_frame"):
                frame = getattr(obj, attr, None)
                if frame is not None:
                    break
            if frame is None:
                if not (hasattr(obj, "cr_await") or hasattr(obj, "gi_yieldfrom")):
                    lines.append(f"  awaiting {repr(obj)[:200]}")
                break
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
            nxt = getattr(obj, "cr_await", None)
            if nxt is None:
                nxt = getattr(obj, "gi_yieldfrom", None)
            obj = nxt
    return "\n".join(lines) + "\n" if lines else "(no tasks)\n"


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 200:
        first = first[:200] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _error_reply(run_id: int, rank: int, exc: BaseException, aborted: bool) -> tuple[Any, ...]:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    text = f"Traceback of rank {rank} (pid {os.getpid()}):\n{tb}"
    blob: bytes | None
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:
        blob = None
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return (
        "result",
        run_id,
        "err",
        blob,
        name,
        str(exc),
        text,
        f"rank {rank}: {_describe(exc)}",
        aborted,
    )


async def _main(task: dict[str, Any], rank: int, store: Any, state: dict[str, bool]) -> Any:
    global _current_loop
    if task["loop"] != "trio":
        loop = asyncio.get_running_loop()
        loop.set_default_executor(_NoWaitExecutor(thread_name_prefix=f"asynccoll-rank{rank}"))
        _current_loop = loop
    fn, args = task["fn"], task["args"]
    backend = task["backend"]
    world_size, timeout = task["world_size"], task["timeout"]
    if backend is None:
        ctx = RankContext(rank=rank, world_size=world_size, store=store, timeout=timeout)
        return await fn(ctx, *args)
    import asynccoll as ac

    comm = await ac.init(
        backend,
        rank=rank,
        world_size=world_size,
        store=store,
        timeout=task["init_timeout"] or timeout,
    )
    try:
        return await fn(comm, *args)
    except BaseException:
        state["aborted"] = True
        comm.abort(f"rank {rank} raised in the test function")
        raise
    finally:
        if comm.state == "aborted":
            state["aborted"] = True
        try:
            with anyio.fail_after(10):
                await comm.close()
        except BaseException:  # an aborted comm, or a close that hung: this worker is not clean
            state["aborted"] = True


def _run(
    msg: tuple[Any, ...], rank: int, client: Any, send: Callable[[Any], None]
) -> tuple[Any, ...]:
    global _current_loop
    _, run_id, sys_path, payload = msg
    state = {"aborted": False}
    try:
        added = [p for p in sys_path if p not in sys.path]
        if added:
            sys.path.extend(added)
        importlib.invalidate_caches()
        task = pickle.loads(payload)  # may import fn's module: not counted in the run's timeout
        send(("started", run_id))
        import torch.distributed as dist

        timeout = task["timeout"]
        client.set_timeout(timedelta(seconds=task["init_timeout"] or timeout))
        store = dist.PrefixStore(f"run{run_id}/", client)
        factory = None
        if task["loop"] == "uvloop":
            import uvloop

            factory = uvloop.new_event_loop
        if task["loop"] == "trio":
            import trio

            value = trio.run(_main, task, rank, store, state)
        else:
            with asyncio.Runner(loop_factory=factory) as runner:
                value = runner.run(_main(task, rank, store, state))
    except BaseException as exc:
        return _error_reply(run_id, rank, exc, True)
    finally:
        _current_loop = None
    try:
        blob = pickle.dumps(value)
    except Exception as exc:
        err = TypeError(
            f"rank {rank} returned a value that cannot be pickled: {type(value).__name__}: {exc}"
        )
        return _error_reply(run_id, rank, err, True)
    return ("result", run_id, "ok", blob, state["aborted"])


def main(rank: int, conn: Any, host: str, port: int, parent_pid: int, stack_path: str) -> None:
    """Entry point of a worker process (``multiprocessing`` spawn target)."""
    started = time.monotonic()
    send_lock = threading.Lock()

    def send(obj: Any) -> None:
        with send_lock:
            conn.send(obj)

    first_ppid = os.getppid()  # the caller (spawn) or the fork server, which exits with it

    def orphaned() -> None:
        try:
            os.unlink(stack_path)  # in case the parent cannot remove it any more
        except OSError:
            pass
        os._exit(70)

    def watchdog() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                orphaned()
            except PermissionError:
                pass
            if os.getppid() != first_ppid:
                orphaned()

    threading.Thread(target=watchdog, name="asynccoll-watchdog", daemon=True).start()
    stack_file = open(stack_path, "a", buffering=1)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    try:
        import torch.distributed as dist

        import asynccoll  # noqa: F401  (imported once, here, not per run)

        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
    except BaseException as exc:
        send(("failed", f"{type(exc).__name__}: {exc}"))
        os._exit(1)

    tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def reader() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the parent closed the pipe, or died
                orphaned()
            if msg[0] == "dump":
                try:
                    send(("stacks", format_tasks(_current_loop)))
                except (OSError, ValueError):  # the pipe is gone: the parent stopped asking
                    pass
            elif msg[0] == "exit":
                os._exit(0)
            else:
                tasks.put(msg)

    threading.Thread(target=reader, name="asynccoll-reader", daemon=True).start()
    send(("ready", os.getpid(), time.monotonic() - started))
    while True:
        msg = tasks.get()
        reply = _run(msg, rank, client, send)
        try:
            send(reply)
        except Exception:
            os._exit(1)
