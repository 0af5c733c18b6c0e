"""The set-up threads behind ``run_in_thread`` (``_base/aio.py``): reused, never shared."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from asynccoll._base import aio


def _thread() -> threading.Thread:
    # (the object, not its ident: an ended thread's ident may be given to the next)
    return threading.current_thread()


def test_a_hop_wakes_the_idle_thread_of_the_last_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hop off the loop wakes a waiting thread instead of starting one: on a busy
    machine a new thread starts behind every running one. The thread is idle before
    its outcome reaches the waiter (CI, beside other tests: it went idle after the next
    hop, which then started a second thread)."""
    monkeypatch.setattr(aio, "_IDLE_S", 30.0)  # no stall of the test machine ends it
    unregister = aio.shutdown.unregister_native_thread

    def slow_unregister(thread: threading.Thread) -> None:
        time.sleep(0.05)  # a thread descheduled as its job ends (a busy machine)
        unregister(thread)

    monkeypatch.setattr(aio.shutdown, "unregister_native_thread", slow_unregister)

    async def main() -> list[threading.Thread]:
        return [await aio.run_in_thread(_thread, 10) for _ in range(5)]

    threads = anyio.run(main)
    assert len(set(threads)) == 1, threads


def test_a_job_that_blocks_holds_only_its_own_thread() -> None:
    release = threading.Event()

    def blocks() -> threading.Thread:
        release.wait(10)
        return threading.current_thread()

    async def main() -> tuple[threading.Thread, threading.Thread]:
        async with anyio.create_task_group() as tg:
            first: list[threading.Thread] = []

            async def run_blocked() -> None:
                first.append(await aio.run_in_thread(blocks, 10))

            tg.start_soon(run_blocked)
            await anyio.sleep(0.05)
            with anyio.fail_after(5):  # not behind the blocked job
                other = await aio.run_in_thread(_thread, 10)
            release.set()
        return first[0], other

    blocked, other = anyio.run(main)
    assert blocked is not other


def test_an_idle_thread_ends_and_the_next_hop_starts_one() -> None:
    async def hop() -> threading.Thread:
        thread: threading.Thread = await aio.run_in_thread(_thread, 10)
        return thread

    first = anyio.run(hop)
    end = time.monotonic() + aio._IDLE_S + 5
    while first.is_alive():
        assert time.monotonic() < end, "the idle thread never ended"
        time.sleep(0.05)
    assert anyio.run(hop) is not first  # (an ident may be reused: the objects differ)


def test_a_job_runs_under_its_name_and_idles_under_another() -> None:
    def name() -> str:
        return threading.current_thread().name

    async def main() -> str:
        return str(await aio.run_in_thread(name, 10, name="asynccoll-test-job"))

    assert anyio.run(main) == "asynccoll-test-job"
    end = time.monotonic() + 5
    while any(t.name == "asynccoll-test-job" for t in threading.enumerate()):
        assert time.monotonic() < end, "the thread kept the job's name"
        time.sleep(0.01)


def test_an_error_reaches_the_caller_and_the_thread_is_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(aio, "_IDLE_S", 30.0)

    def fails() -> None:
        raise ValueError("boom")

    async def main() -> list[threading.Thread]:
        threads = []
        for _ in range(2):
            with pytest.raises(ValueError, match="boom"):
                await aio.run_in_thread(fails, 10)
            threads.append(await aio.run_in_thread(_thread, 10))
        return threads

    a, b = anyio.run(main)
    assert a is b
