"""Tests of the ``streams`` package.

The CPU tests drive :class:`streams.EventWatcher` and :func:`streams.wait_event` with fake
events (``query``/``synchronize`` on a :class:`threading.Event`), under asyncio and uvloop.
The GPU tests at the end run on the simulated GPU (``asynccoll.testing.simgpu``: doubles of
``torch.cuda`` and ``cuda.bindings.driver``, streams unmodified) and, where torch sees a
CUDA device, on it too.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from typing import Any, Awaitable, Callable

import pytest
import torch

import streams

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a test dependency
    uvloop = None

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda)")
no_cuda = pytest.mark.skipif(HAS_CUDA, reason="checks the errors raised without CUDA")

DEADLINE = 10.0

LOOPS = [
    pytest.param(asyncio.new_event_loop, id="asyncio"),
    pytest.param(
        getattr(uvloop, "new_event_loop", None),
        id="uvloop",
        marks=pytest.mark.skipif(uvloop is None, reason="uvloop not installed"),
    ),
]


# -- helpers ------------------------------------------------------------------------------


class FakeEvent:
    """A CUDA-event stand-in: completes when :meth:`complete` is called from any thread."""

    def __init__(self, name: object = None, *, done: bool = False) -> None:
        self.name = name
        self._done = threading.Event()
        if done:
            self._done.set()
        self.queries = 0
        self.syncs = 0

    def query(self) -> bool:
        self.queries += 1
        return self._done.is_set()

    def synchronize(self) -> None:
        self.syncs += 1
        assert self._done.wait(DEADLINE), f"{self!r} never completed"

    def complete(self) -> None:
        self._done.set()

    def __repr__(self) -> str:
        return f"FakeEvent({self.name!r})"


class BrokenEvent(FakeEvent):
    """An event whose wait fails, like a CUDA error surfacing from cudaEventQuery."""

    def query(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def run_on(loop_factory: Callable[[], asyncio.AbstractEventLoop], coro: Awaitable[Any]) -> Any:
    """Run ``coro`` on a fresh loop from ``loop_factory`` with a deadline."""
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(asyncio.wait_for(coro, DEADLINE))


def complete_later(delay: float, *events: FakeEvent) -> threading.Thread:
    """Complete ``events`` in the given order from another thread after ``delay`` seconds."""

    def body() -> None:
        time.sleep(delay)
        for ev in events:
            ev.complete()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def wait_until(pred: Callable[[], bool], timeout: float = DEADLINE) -> None:
    """Block (briefly polling) until ``pred()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def watcher_threads(label: object) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"streams-watcher-{label}"]


@pytest.fixture
def watcher(request: pytest.FixtureRequest):
    """An EventWatcher with a unique label, closed (bounded) after the test."""
    w = streams.EventWatcher(f"test-{request.node.name}")
    yield w
    assert w.close(timeout=2.0, drain=False) or not w.thread.is_alive()


# -- import and CUDA errors -----------------------------------------------------------------


def test_import_starts_no_thread_and_no_cuda() -> None:
    code = (
        "import threading, sys, torch\n"
        "before = threading.active_count()\n"
        "import streams\n"
        "assert threading.active_count() == before, threading.enumerate()\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert 'cupy' not in sys.modules\n"
        "print('ok', sorted(streams.__all__) == sorted(set(streams.__all__)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok True"


def test_public_names() -> None:
    for name in streams.__all__:
        assert hasattr(streams, name), name
    for name in (
        "CudaUnavailable",
        "EventPool",
        "EventWatcher",
        "LoopWaker",
        "wait_event",
        "comm_stream",
        "current_stream",
        "as_torch_tensor",
        "StreamSet",
        "cuda_available",
    ):
        assert name in streams.__all__
    assert issubclass(streams.CudaUnavailable, RuntimeError)
    assert streams.EventWatcher.__module__ == "streams"


@no_cuda
@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: streams.comm_stream(0), id="comm_stream"),
        pytest.param(lambda: streams.StreamSet().get("cuda:0"), id="StreamSet.get"),
        pytest.param(lambda: streams.EventPool(0).acquire(), id="EventPool.acquire"),
        pytest.param(lambda: streams.current_stream(0), id="current_stream(0)"),
        pytest.param(lambda: streams.current_stream(), id="current_stream()"),
        pytest.param(lambda: streams.current_stream(torch.device("cuda", 0)), id="device"),
    ],
)
def test_cuda_unavailable_is_explained(call: Callable[[], Any]) -> None:
    assert streams.cuda_available() is False
    with pytest.raises(streams.CudaUnavailable) as info:
        call()
    msg = str(info.value)
    assert "needs CUDA" in msg
    assert ("built without CUDA" in msg and "pip install torch" in msg) or (
        "no CUDA device" in msg and "nvidia-smi" in msg
    )


@no_cuda
def test_cuda_array_objects_without_cuda() -> None:
    class CudaArray:
        __cuda_array_interface__ = {
            "shape": (4,),
            "typestr": "<f4",
            "data": (1234, False),
            "version": 3,
            "stream": None,
        }

    class CudaStreamLike:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 1234)

    with pytest.raises(streams.CudaUnavailable, match="current_stream"):
        streams.current_stream(CudaArray())
    with pytest.raises(streams.CudaUnavailable, match="current_stream"):
        streams.current_stream(CudaStreamLike())
    with pytest.raises(streams.CudaUnavailable, match="as_torch_tensor"):
        streams.as_torch_tensor(CudaArray())


def test_device_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        streams.StreamSet().get("cpu")
    with pytest.raises(ValueError, match=">= 0"):
        streams.StreamSet().get(-1)
    with pytest.raises(TypeError, match="CUDA device"):
        streams.StreamSet().get(1.5)  # type: ignore[arg-type]


def test_interop_on_cpu() -> None:
    np = pytest.importorskip("numpy")
    t = torch.arange(4.0)
    assert streams.as_torch_tensor(t) is t
    arr = np.arange(4, dtype=np.float32)
    shared = streams.as_torch_tensor(arr)
    assert isinstance(shared, torch.Tensor)
    shared[0] = 42.0
    assert arr[0] == 42.0  # same memory
    with pytest.raises(TypeError, match="as_torch_tensor"):
        streams.as_torch_tensor([1, 2, 3])
    with pytest.raises(TypeError, match="current_stream"):
        streams.current_stream(object())
    with pytest.raises(ValueError, match="no CUDA stream"):
        streams.current_stream(t)
    with pytest.raises(ValueError, match="not CUDA"):
        streams.current_stream(arr)


# -- EventWatcher ---------------------------------------------------------------------------


def test_callbacks_run_in_issue_order(watcher: streams.EventWatcher) -> None:
    events = [FakeEvent(i) for i in range(5)]
    order: list[int] = []
    all_done = threading.Event()

    def cb(i: int) -> None:
        assert events[i].query(), "callback before its event completed"
        order.append(i)
        if len(order) == len(events):
            all_done.set()

    for i, ev in enumerate(events):
        watcher.watch(ev, cb, i)
    assert watcher.pending == 5
    for ev in reversed(events[1:]):  # later events complete first
        ev.complete()
    time.sleep(0.05)
    assert order == [], "a later event's callback ran before the head event completed"
    events[0].complete()
    assert all_done.wait(DEADLINE)
    assert order == [0, 1, 2, 3, 4]
    assert watcher.pending == 0


def test_one_thread_per_watcher(watcher: streams.EventWatcher) -> None:
    before = set(threading.enumerate())
    assert watcher.thread is None  # lazily started
    events = [FakeEvent(i) for i in range(300)]
    seen: list[int] = []
    for i, ev in enumerate(events):
        watcher.watch(ev, seen.append, i)
    assert set(threading.enumerate()) - before == {watcher.thread}
    assert watcher_threads(watcher.device) == [watcher.thread]
    assert watcher.thread.daemon
    finisher = complete_later(0.01, *events)
    wait_until(lambda: len(seen) == len(events))
    finisher.join(DEADLINE)
    assert seen == list(range(300))
    assert set(threading.enumerate()) - before == {watcher.thread}
    assert watcher.close(timeout=DEADLINE) is True
    assert not watcher.thread.is_alive()
    assert watcher_threads(watcher.device) == []


def test_spin_catches_fast_events_and_sync_mode_blocks() -> None:
    # No timers: the fast event completes on its 2nd query (inside a long spin), the
    # slow one only once the watcher gives up spinning and calls synchronize().
    class Fast(FakeEvent):
        def query(self) -> bool:
            if self.queries >= 1:
                self.complete()
            return super().query()

    class Slow(FakeEvent):
        def synchronize(self) -> None:
            self.complete()
            super().synchronize()

    fast, slow = Fast("fast"), Slow("slow")
    w = streams.EventWatcher("spin-sync", spin=1.0)  # long: robust to a descheduled thread
    got = threading.Event()
    w.watch(fast, lambda: None)
    w.watch(slow, got.set)
    assert got.wait(DEADLINE)
    assert fast.syncs == 0 and fast.queries >= 2
    assert slow.syncs == 1 and slow.queries >= 2
    assert w.close(timeout=DEADLINE)


def test_poll_mode_never_synchronizes() -> None:
    w = streams.EventWatcher("poll", mode="poll", spin=1e-5, poll_interval=0.002)
    ev = FakeEvent()
    got = threading.Event()
    w.watch(ev, got.set)
    complete_later(0.05, ev)
    assert got.wait(DEADLINE)
    assert ev.syncs == 0 and ev.queries > 2
    assert w.close(timeout=DEADLINE)
    with pytest.raises(ValueError):
        streams.EventWatcher(mode="busy")  # type: ignore[arg-type]


def test_callback_exceptions_do_not_kill_the_thread() -> None:
    errors: list[tuple[str, BaseException]] = []
    w = streams.EventWatcher("errors", error_handler=lambda m, e: errors.append((m, e)))
    got = threading.Event()

    def bad() -> None:
        raise ZeroDivisionError("boom")

    w.watch(FakeEvent(done=True), bad)
    w.watch(FakeEvent(done=True), got.set)
    assert got.wait(DEADLINE)
    assert len(errors) == 1 and isinstance(errors[0][1], ZeroDivisionError)
    assert "callback" in errors[0][0]
    assert w.thread.is_alive()
    assert w.close(timeout=DEADLINE)


def test_callback_exceptions_are_logged_by_default(caplog: pytest.LogCaptureFixture) -> None:
    w = streams.EventWatcher("logged")
    got = threading.Event()
    with caplog.at_level(logging.ERROR, logger="streams"):
        w.watch(FakeEvent(done=True), lambda: 1 / 0)
        w.watch(FakeEvent(done=True), got.set)
        assert got.wait(DEADLINE)
        assert w.close(timeout=DEADLINE)
    records = [r for r in caplog.records if r.name == "streams"]
    assert len(records) == 1 and records[0].exc_info[0] is ZeroDivisionError


def test_failed_wait_calls_on_fail_and_continues(watcher: streams.EventWatcher) -> None:
    failures: list[BaseException] = []
    called: list[str] = []
    got = threading.Event()
    watcher.watch(BrokenEvent(), called.append, "broken", on_fail=failures.append)
    watcher.watch(FakeEvent(done=True), got.set)
    assert got.wait(DEADLINE)
    assert called == []
    assert len(failures) == 1 and "illegal memory access" in str(failures[0])


def test_close_is_bounded_and_idempotent() -> None:
    w = streams.EventWatcher("close-hung")
    assert w.close(timeout=0.1) is True  # never started
    w = streams.EventWatcher("close-hung")
    hung, queued = FakeEvent("hung"), FakeEvent("queued")
    ran: list[str] = []
    failed: list[BaseException] = []
    w.watch(hung, ran.append, "hung", on_fail=failed.append)
    w.watch(queued, ran.append, "queued", on_fail=failed.append)
    wait_until(lambda: hung.syncs == 1)  # the thread is inside synchronize() on the head
    t0 = time.monotonic()
    assert w.close(timeout=0.1) is False  # stuck in synchronize(), but close returns
    assert w.close(timeout=0.1) is False  # idempotent, still bounded
    # Bounded: both returned while the head is still stuck (unbounded, they would wait
    # for it forever). Generous: two 0.1 s closes took 1.16 s once at load 12.
    assert time.monotonic() - t0 < 5.0
    assert w.closed
    assert len(failed) == 1 and isinstance(failed[0], streams.WatcherClosed)  # "queued"
    with pytest.raises(streams.WatcherClosed):
        w.watch(FakeEvent(done=True), ran.append, "late")
    hung.complete()  # the head's wait ends: its callback still runs, then the thread exits
    w.thread.join(DEADLINE)
    assert not w.thread.is_alive()
    assert ran == ["hung"]
    assert w.close(timeout=0.1) is True


def test_close_drains_by_default() -> None:
    w = streams.EventWatcher("close-drain")
    events = [FakeEvent(i) for i in range(3)]
    ran: list[int] = []
    for i, ev in enumerate(events):
        w.watch(ev, ran.append, i)
    complete_later(0.05, *events)
    assert w.close(timeout=DEADLINE) is True
    assert ran == [0, 1, 2]
    assert w.pending == 0


def test_close_without_drain_interrupts_poll_mode() -> None:
    w = streams.EventWatcher("close-poll", mode="poll", poll_interval=0.005)
    failed: list[BaseException] = []
    ran: list[int] = []
    for i in range(3):
        w.watch(FakeEvent(i), ran.append, i, on_fail=failed.append)
    time.sleep(0.02)
    assert w.close(timeout=DEADLINE, drain=False) is True
    assert not w.thread.is_alive()
    assert ran == []
    assert len(failed) == 3 and all(isinstance(e, streams.WatcherClosed) for e in failed)


# -- LoopWaker --------------------------------------------------------------------------------


def _spy_threadsafe(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Count loop.call_soon_threadsafe calls (instance attribute shadows the method)."""
    calls: list[int] = []
    original = loop.call_soon_threadsafe

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    loop.call_soon_threadsafe = spy  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_loop_waker_batches_a_burst(loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    n = 1000

    async def main() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        calls = _spy_threadsafe(loop)
        waker = streams.LoopWaker(loop)
        results: list[int] = []
        done = asyncio.Event()

        def producer() -> None:
            for i in range(n):
                assert waker.post(results.append, i)
            waker.post(done.set)

        t = threading.Thread(target=producer)
        t.start()
        t.join(DEADLINE)  # the loop is blocked: the whole burst is queued before it drains
        assert waker.pending() == n + 1
        await done.wait()
        return results, len(calls)

    results, calls = run_on(loop_factory, main())
    assert results == list(range(n))
    assert calls == 1


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_loop_waker_concurrent_producers_keep_fifo(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    n_threads, bursts, burst = 4, 10, 100

    async def main() -> tuple[list[tuple[int, int]], int]:
        loop = asyncio.get_running_loop()
        calls = _spy_threadsafe(loop)
        waker = streams.LoopWaker(loop)
        results: list[tuple[int, int]] = []
        total = n_threads * bursts * burst
        done = asyncio.Event()

        def record(item: tuple[int, int]) -> None:
            results.append(item)
            if len(results) == total:
                done.set()

        def producer(k: int) -> None:
            for b in range(bursts):
                for i in range(burst):
                    waker.post(record, (k, b * burst + i))
                time.sleep(0.001)

        threads = [threading.Thread(target=producer, args=(k,)) for k in range(n_threads)]
        for t in threads:
            t.start()
        await done.wait()
        for t in threads:
            t.join(DEADLINE)
        return results, len(calls)

    results, calls = run_on(loop_factory, main())
    assert len(results) == n_threads * bursts * burst
    for k in range(n_threads):  # each producer's posts run in its order
        mine = [i for (kk, i) in results if kk == k]
        assert mine == list(range(bursts * burst))
    assert calls <= len(results) // 10, f"{calls} wake-ups for {len(results)} posts"


@pytest.mark.asyncio
async def test_loop_waker_on_loop_thread_and_errors() -> None:
    loop = asyncio.get_running_loop()
    calls = _spy_threadsafe(loop)
    seen: list[Any] = []
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx["exception"]))
    try:
        waker = streams.loop_waker()
        assert streams.loop_waker(loop) is waker
        out: list[int] = []
        waker.post(out.append, 1)
        waker.post(lambda: 1 / 0)
        waker.post(out.append, 2)
        assert out == []  # never run synchronously inside post()
        for _ in range(3):
            await asyncio.sleep(0)
        assert out == [1, 2]
        assert calls == []  # on the loop thread: call_soon, no self-pipe write
        assert len(seen) == 1 and isinstance(seen[0], ZeroDivisionError)
    finally:
        loop.set_exception_handler(None)


def test_loop_waker_closed_loop() -> None:
    loop = asyncio.new_event_loop()
    waker = streams.LoopWaker(loop)
    loop.close()
    ran: list[int] = []
    assert waker.post(ran.append, 1) is False
    assert ran == [] and waker.pending() == 0


def test_loop_waker_loop_closing_while_posting() -> None:
    # The loop closes between post()'s is_closed() check and call_soon_threadsafe: the
    # posted callable is dropped and post() says so, and the next post starts afresh.
    class ClosingLoop(asyncio.SelectorEventLoop):
        fail = True

        def call_soon_threadsafe(self, *a: Any, **k: Any) -> Any:
            if self.fail:
                raise RuntimeError("Event loop is closed")
            return super().call_soon_threadsafe(*a, **k)

    loop = ClosingLoop()
    try:
        waker = streams.LoopWaker(loop)
        assert waker.loop is loop and "pending=0" in repr(waker)
        ran: list[int] = []
        assert waker.post(ran.append, 1) is False and waker.pending() == 0
        ClosingLoop.fail = False
        assert waker.post(ran.append, 2) is True  # not stuck "scheduled"
        loop.run_until_complete(asyncio.sleep(0.01))
        assert ran == [2]
    finally:
        loop.close()


# -- wait_event ---------------------------------------------------------------------------


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_wait_event_wakes_the_loop(
    loop_factory: Callable[[], asyncio.AbstractEventLoop], watcher: streams.EventWatcher
) -> None:
    ev = FakeEvent()

    async def main() -> tuple[int, float, str]:
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.002)
                ticks += 1

        hb = asyncio.create_task(heartbeat())
        t0 = time.monotonic()
        complete_later(0.15, ev)
        await asyncio.wait_for(streams.wait_event(ev, watcher=watcher), DEADLINE)
        elapsed = time.monotonic() - t0
        assert ev.query()
        hb.cancel()
        return ticks, elapsed, type(asyncio.get_running_loop()).__module__

    ticks, elapsed, loop_module = run_on(loop_factory, main())
    assert elapsed >= 0.14
    assert ticks >= 10, f"the loop stalled while waiting ({ticks} heartbeats)"
    assert loop_module.startswith(
        "uvloop" if loop_factory is not asyncio.new_event_loop else "asyncio"
    )


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_wait_event_resumes_in_issue_order(
    loop_factory: Callable[[], asyncio.AbstractEventLoop], watcher: streams.EventWatcher
) -> None:
    events = [FakeEvent(i) for i in range(20)]

    async def main() -> list[int]:
        order: list[int] = []

        async def waiter(i: int) -> None:
            await streams.wait_event(events[i], watcher=watcher)
            order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(len(events))]
        await asyncio.sleep(0.01)
        complete_later(0.0, *reversed(events))
        await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE)
        return order

    assert run_on(loop_factory, main()) == list(range(20))
    assert len(watcher_threads(watcher.device)) == 1


@pytest.mark.asyncio
async def test_wait_event_already_complete_skips_the_watcher() -> None:
    w = streams.EventWatcher("unused")
    await asyncio.wait_for(streams.wait_event(FakeEvent(done=True), watcher=w), DEADLINE)
    assert w.thread is None and w.pending == 0


@pytest.mark.asyncio
async def test_wait_event_default_watcher_per_device() -> None:
    shared, dev = FakeEvent("shared"), FakeEvent("dev")
    dev.device = torch.device("cuda", 7)  # what a recorded torch.cuda.Event reports
    waiters = [asyncio.ensure_future(streams.wait_event(ev)) for ev in (shared, dev)]
    for _ in range(int(DEADLINE / 0.005)):  # both are queued on their watchers (no timing race)
        if streams.default_watcher().pending and streams.default_watcher(7).pending:
            break
        await asyncio.sleep(0.005)
    complete_later(0.0, shared, dev)
    await asyncio.wait_for(asyncio.gather(*waiters), DEADLINE)
    assert shared.query() and dev.query()
    assert streams.default_watcher() is streams.default_watcher(None)
    assert streams.default_watcher(7) is not streams.default_watcher()
    assert len(watcher_threads("shared")) == 1
    assert len(watcher_threads(7)) == 1


@pytest.mark.asyncio
async def test_cancelling_a_waiter_is_safe(watcher: streams.EventWatcher) -> None:
    loop = asyncio.get_running_loop()
    problems: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: problems.append(ctx))
    try:
        ev, later = FakeEvent("cancelled"), FakeEvent("later")
        task = asyncio.create_task(streams.wait_event(ev, watcher=watcher))
        await asyncio.sleep(0.01)
        assert watcher.pending == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, DEADLINE)
        assert watcher.pending == 1  # the watcher still waits for the event
        complete_later(0.01, ev, later)
        await asyncio.wait_for(streams.wait_event(later, watcher=watcher), DEADLINE)
        await asyncio.sleep(0.01)
        assert watcher.pending == 0
        assert watcher.thread.is_alive()
        assert problems == []  # the late wake-up of the cancelled future was ignored
    finally:
        loop.set_exception_handler(None)


@pytest.mark.asyncio
async def test_wait_event_raises_watcher_failures() -> None:
    w = streams.EventWatcher("failures")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        await asyncio.wait_for(streams.wait_event(BrokenEvent(), watcher=w), DEADLINE)
    head, mine = FakeEvent("head"), FakeEvent("mine")
    w.watch(head, lambda: None)
    task = asyncio.create_task(streams.wait_event(mine, watcher=w))
    await asyncio.sleep(0.01)
    wait_until(lambda: head.syncs == 1 and w.pending == 2)
    assert w.close(timeout=0.05, drain=False) is False  # head is stuck in synchronize()
    with pytest.raises(streams.WatcherClosed):
        await asyncio.wait_for(task, DEADLINE)
    head.complete()
    w.thread.join(DEADLINE)
    assert not w.thread.is_alive()


# -- real GPU (skipped without CUDA) ----------------------------------------------------------

SLEEP_CYCLES = 200_000_000  # ~0.1 s at typical GPU clocks


@pytest.fixture(params=["sim", pytest.param("cuda", marks=needs_cuda)])
def gpu(request: pytest.FixtureRequest) -> Any:
    """The device of a GPU test: the simulated GPU, or the real one."""
    if request.param == "cuda":
        yield None
        return
    from asynccoll.testing.simgpu import SimGPU

    sim = SimGPU()
    yield sim
    sim.close()
    assert sim.errors == []


def greatest_priority() -> int:
    from cuda.bindings import driver as cu

    torch.cuda.set_device(0)
    err, _least, greatest = cu.cuCtxGetStreamPriorityRange()
    assert int(err) == 0
    return int(greatest)


def test_gpu_comm_stream_is_dedicated_and_highest_priority(gpu: Any) -> None:
    s = streams.comm_stream(0)
    assert s is streams.comm_stream("cuda:0") is streams.comm_stream(torch.device("cuda", 0))
    assert s.priority == greatest_priority() <= min(torch.cuda.Stream.priority_range())
    assert streams.default_stream_set().priority == s.priority
    pool = {torch.cuda.Stream(priority=p).cuda_stream for p in range(-3, 1) for _ in range(32)}
    assert s.cuda_stream not in pool  # not one of torch's 32 pooled streams per priority
    assert s != torch.cuda.default_stream(0)
    assert s.device == torch.device("cuda", 0)


def test_gpu_event_pool_reuses_events(gpu: Any) -> None:
    pool = streams.EventPool(0)
    assert len(pool) == 0
    a = pool.acquire()
    assert isinstance(a, torch.cuda.Event)
    a.record(streams.comm_stream(0))
    pool.release(a)
    assert len(pool) == 1
    assert pool.acquire() is a
    assert len(pool) == 0
    b = pool.acquire()
    assert b is not a and pool.created == 2
    timed = streams.EventPool("cuda:0", timing=True).acquire()
    s = torch.cuda.current_stream(0)
    start = timed
    end = torch.cuda.Event(enable_timing=True)
    start.record(s)
    end.record(s)
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_gpu_wait_event_resumes_after_kernel(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
    gpu: Any,
) -> None:
    pool = streams.EventPool(0)

    async def main() -> tuple[int, float]:
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        hb = asyncio.create_task(heartbeat())
        s = streams.comm_stream(0)
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP_CYCLES)
        ev = pool.acquire()
        ev.record(s)
        assert not ev.query(), "the kernel finished before we could wait for it"
        t0 = time.monotonic()
        await asyncio.wait_for(streams.wait_event(ev), DEADLINE)
        elapsed = time.monotonic() - t0
        assert ev.query()
        pool.release(ev)
        hb.cancel()
        return ticks, elapsed

    ticks, elapsed = run_on(loop_factory, main())
    assert elapsed > 0.005
    assert ticks >= 3, "the loop was blocked while the GPU worked"
    assert len(watcher_threads(0)) == 1  # the default watcher of cuda:0


def test_gpu_current_stream_of_tensor_and_device(gpu: Any) -> None:
    t = torch.ones(4, device="cuda:0")
    s = streams.comm_stream(0)
    with torch.cuda.stream(s):
        assert streams.current_stream(t) == s
        assert streams.current_stream() == s
        assert streams.current_stream(0) == s
    assert streams.current_stream(t) == torch.cuda.current_stream(0)
    assert streams.current_stream(s) is s

    class Foreign:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, s.cuda_stream)

    assert streams.current_stream(Foreign()).cuda_stream == s.cuda_stream
    assert streams.as_torch_tensor(t) is t


def test_gpu_current_stream_of_foreign_arrays(gpu: Any) -> None:
    if gpu is None:
        pytest.skip("the simulated GPU decides which devices exist here")
    pytest.importorskip("cuda.bindings")
    side = gpu.stream("side")

    class Cai:  # CuPy-like, without CuPy: __cuda_array_interface__ v3 with its stream
        def __init__(self, stream: int | None) -> None:
            self.__cuda_array_interface__ = {
                "shape": (4,),
                "typestr": "<f4",
                "data": (0x10, False),
                "version": 3,
                "stream": stream,
            }

    class OnDevice:  # DLPack device only (device type 2 = CUDA)
        def __init__(self, index: int) -> None:
            self.index = index

        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, self.index)

    class CupyLike:  # .device.id, as CuPy arrays have
        __cuda_array_interface__ = {
            "shape": (1,),
            "typestr": "<f4",
            "data": (0x10, False),
            "version": 3,
        }

        class device:  # noqa: N801 - CuPy's attribute name
            id = 0

    assert streams.current_stream(Cai(side.cuda_stream)) == side
    assert streams.current_stream(Cai(None)) == torch.cuda.current_stream(0)
    assert streams.current_stream(Cai(1)) == torch.cuda.default_stream(
        0
    )  # the legacy default stream
    with torch.cuda.stream(side):
        assert streams.current_stream(OnDevice(0)) == side
        assert streams.current_stream(CupyLike()) == side
    assert streams.current_stream(OnDevice(0)) == torch.cuda.current_stream(0)

    class BadStream:
        def __cuda_stream__(self) -> Any:
            return "not a pair"

    with pytest.raises(TypeError, match="version, ptr"):
        streams.current_stream(BadStream())


def test_gpu_own_streams_are_handed_out_once(gpu: Any) -> None:
    own = streams.own_streams()
    a, b = own.acquire(0), own.acquire(0)
    assert a != b and a.priority == greatest_priority()
    own.release(a)
    assert own.acquire(0) is a
    low = own.acquire(0, priority=0)
    assert low.priority == 0 and low not in (a, b)
    own.release(a)
    own.release(b)
    own.release(low)


@needs_cuda
def test_gpu_cupy_interop() -> None:
    cupy = pytest.importorskip("cupy")
    a = cupy.arange(8, dtype=cupy.float32)
    with cupy.cuda.Stream(non_blocking=True) as cs:
        st = streams.current_stream(a)
        assert st.cuda_stream == cs.ptr
    t = streams.as_torch_tensor(a)
    assert t.is_cuda and t.data_ptr() == a.data.ptr
    t[0] = 42
    torch.cuda.synchronize()
    assert float(a[0]) == 42.0
