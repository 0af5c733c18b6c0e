"""asynccoll elastic training: a rank dies, the survivors shrink and train on, its launcher
restarts it, it joins, receives the model and optimizer state, and all finish bit-equal.

    python examples/elastic.py                   # the launch recipe below, run for you
    python examples/elastic.py --kill-step 10 --steps 60 --png /tmp/elastic.png

The launch recipe that keeps survivors alive (what this file's launcher runs):

    python -m asynccoll.store --port 29400 &           # a store that outlives every rank
    for r in 0 1 2; do                                 # one single-node torchrun per rank:
      torchrun --standalone --nnodes 1 --nproc-per-node 1 --max-restarts 3 \\
          examples/elastic.py --rank $r --world-size 3 --store HOST:29400 &
    done

A single ``torchrun --nproc-per-node 3`` stops every worker as soon as one dies, so
each rank gets a launcher of its own; a worker that dies is restarted by its own
torchrun (``TORCHELASTIC_RESTART_COUNT > 0``), and joins. Under Slurm the same idea
is one task per rank with ``srun --kill-on-bad-exit=0`` and a requeue or restart loop.

Three ranks train an MLP with ``GradSync``, data-parallel. At ``--kill-step`` rank
``--kill-rank`` SIGKILLs itself. The survivors' gradient all-reduce raises
``ac.PeerFailure`` (or, when the news comes while backward still issues buckets,
the next bucket's call raises ``ac.CommAborted``, its base class); they
``shrink()`` and redo that step on two ranks. Its torchrun
starts a new process, which calls ``ac.join``; at the top of each step the members
call ``comm.waiting()``, and when someone waits they ``grow()`` and send the model,
the optimizer state and the step with ``broadcast_state``. At the end every rank
compares a hash of its parameters, and the rank 0 prints the timeline and writes a
PNG of the loss and the world size over the steps.

``--mode torchrun`` is torchrun's own answer, for comparison (``bench/elastic.py``):
one ``torchrun --nproc-per-node 3 --max-restarts 1``; the death stops all workers,
torchrun restarts all of them, and they resume from the last checkpoint.
"""

from __future__ import annotations

import time

T0 = time.time()  # this process's start, for the timeline (before importing torch)

import argparse  # noqa: E402 - after T0 on purpose
import asyncio  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import asynccoll as ac  # noqa: E402

GROUP = "train"
ORDER = [
    "death",
    "detected",
    "shrunk",
    "resumed",
    "replacement started",
    "join called",
    "grow started",
    "joined",
    "rejoined",
    "state received",
    "first joint step",
]


# ---------------------------------------------------------------------- training
def make_model(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same start on every rank
    layers: list[torch.nn.Module] = []
    width = args.features
    for _ in range(args.depth):
        layers += [torch.nn.Linear(width, args.width), torch.nn.Tanh()]
        width = args.width
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    return model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def batch(
    step: int, rank: int, world_size: int, args: argparse.Namespace
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of step ``step``'s batch (the same global batch at any world size)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(args.batch, args.features, generator=gen)
    y = torch.sin(x[:, :1] * 2) + x[:, 1:2] * x[:, 2:3]
    return x[rank::world_size], y[rank::world_size]


def held_out_loss(model: torch.nn.Module, args: argparse.Namespace) -> float:
    """The loss on a fixed held-out batch: one step's loss on a random shard is too noisy to
    tell whether the model learnt."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1024, args.features, generator=gen)
    y = torch.sin(x[:, :1] * 2) + x[:, 1:2] * x[:, 2:3]
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def finished(step: int, back_at: int, world_size: int, args: argparse.Namespace) -> bool:
    """Stop after ``--steps``, but not before the group is whole again and trained 5 steps so.

    Every rank decides alike (from the step and the world size), so they stop together.
    """
    if step >= args.max_steps:
        return True
    return step >= args.steps and world_size == args.world_size and step >= back_at + 5


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


class Events:
    """Timeline marks in the store, first writer wins (any rank may record one)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = dist.PrefixStore("elastic-example", store)

    async def mark(self, name: str, detail: str = "", at: float | None = None) -> None:
        value = json.dumps([at if at is not None else time.time(), detail])
        await asyncio.to_thread(self.store.compare_set, f"event/{name}", "", value)

    async def finished(self) -> bool:
        return bool(await asyncio.to_thread(self.store.check, ["event/finished"]))

    def read(self) -> dict[str, tuple[float, str]]:
        keys = [f"event/{name}" for name in ORDER]
        return {
            name: tuple(json.loads(self.store.get(k)))  # type: ignore[misc]
            for name, k in zip(ORDER, keys)
            if self.store.check([k])
        }


async def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # several ranks share this machine's cores
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    host, port = args.store.rsplit(":", 1)
    store = await asyncio.to_thread(
        dist.TCPStore, host, int(port), is_master=False, timeout=timedelta(seconds=60)
    )
    events = Events(store)
    model, opt = make_model(args)
    history: list[tuple[int, float, int]] = []  # (step, loss on rank 0's shard, world size)
    step, just_joined = 0, False
    if args.mode == "torchrun":  # torchrun's answer: everyone restarts from a checkpoint
        me = int(os.environ["RANK"])
        comm = await ac.init("gloo", timeout=60)  # RANK, WORLD_SIZE, the agent's store
        if restart:
            await events.mark(
                "replacement started", f"torchrun restarted all {comm.world_size} workers", T0
            )
            just_joined = True  # (marks the first step after the restart)
            if os.path.exists(args.checkpoint):
                saved = torch.load(args.checkpoint, weights_only=False)
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["opt"])
                step, history = saved["step"], saved["history"]
    elif restart == 0:
        me = args.rank
        comm = await ac.init(
            "gloo", rank=me, world_size=args.world_size, store=store, name=GROUP, timeout=60
        )
    else:  # restarted by its torchrun: join the running group
        me = args.rank
        if await events.finished():  # restarted after the end (a crash at exit): nothing to join
            print(f"rank {me}: the job has finished, nothing to join", flush=True)
            return
        await events.mark("replacement started", f"rank {me}'s torchrun restarted it", T0)
        await events.mark("join called")
        comm = await ac.join("gloo", store=store, name=GROUP, timeout=120)
        await events.mark("joined", f"as rank {comm.rank} of {comm.world_size}")
        state = await comm.broadcast_state(None, src=0)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, history = state["step"], state["history"]
        await events.mark("state received", f"step {step}")
        just_joined = True
    sync = ac.GradSync(comm, model)
    # Marks to record at the next completed step: "resumed" after a shrink (or torchrun's
    # restart), "first joint step" after a grow (or a restart).
    resumed = not (just_joined and args.mode == "torchrun")
    joint = not just_joined
    step_times: list[float] = []
    back_at = step if just_joined else 0  # the step at which the group was last complete
    while not finished(step, back_at, comm.world_size, args):
        if me == args.kill_rank and restart == 0 and step == args.kill_step:
            await events.mark("death", f"rank {me} SIGKILLed at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            if args.mode == "elastic" and not just_joined:
                waiting = await comm.waiting()  # a collective: the same count on every member
                if waiting:
                    await events.mark("grow started", f"{waiting} waiting")
                    sync.close()
                    old = comm
                    comm = await comm.grow(comm.world_size + waiting)
                    sync = ac.GradSync(comm, model)
                    await events.mark(
                        "rejoined", f"{old.world_size} -> {comm.world_size} ranks (grow)"
                    )
                    back_at = step
                    snapshot = {
                        "model": model.state_dict(),
                        "opt": opt.state_dict(),
                        "step": step,
                        "history": history,
                    }
                    await comm.broadcast_state(snapshot if comm.rank == 0 else None, src=0)
                    joint = False
            just_joined = False
            began = time.monotonic()
            await asyncio.sleep(args.step_time)  # stands for the data loader
            x, y = batch(step, comm.rank, comm.world_size, args)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # buckets are all-reduced as their grads are ready
            await sync.wait()
        except ac.CommAborted as failure:  # PeerFailure, or a later call on the aborted comm
            if args.mode == "torchrun":
                raise  # torchrun's answer: it restarts every worker
            await events.mark(
                "detected", f"{type(failure).__name__}: rank(s) {list(comm.failed_ranks)} failed"
            )
            sync.close()
            opt.zero_grad()
            old, comm = comm, await comm.shrink()  # the survivors, renumbered
            await old.close()
            sync = ac.GradSync(comm, model)
            await events.mark("shrunk", f"{old.world_size} -> {comm.world_size} ranks")
            resumed = False
            continue  # redo this step on the survivors
        opt.step()
        opt.zero_grad()
        step_times.append(time.monotonic() - began)
        if not resumed:
            await events.mark("resumed", f"step {step} done on {comm.world_size} ranks")
            resumed = True
        if not joint:
            await events.mark("first joint step", f"step {step} done on {comm.world_size} ranks")
            joint = True
        history.append((step, loss.item(), comm.world_size))
        if comm.rank == 0 and step % 20 == 0:
            print(f"step {step:3d}  loss {loss.item():8.5f}  ({comm.world_size} ranks)", flush=True)
        if args.mode == "torchrun" and comm.rank == 0 and step % args.checkpoint_every == 0:
            snapshot = {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step + 1,
                "history": history,
            }
            await asyncio.to_thread(torch.save, snapshot, args.checkpoint)
        step += 1
    sync.close()
    digests = await comm.all_gather_object(digest(model))
    if comm.rank == 0:
        await events.mark("finished")
        state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        state_bytes += sum(
            t.numel() * t.element_size()
            for s in opt.state_dict()["state"].values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        learnt = (
            held_out_loss(make_model(args)[0], args),
            held_out_loss(model, args),
        )  # (at the start, now)
        report(
            args,
            events,
            history,
            digests,
            comm.world_size,
            {"state_bytes": state_bytes, "step_s": sorted(step_times)[len(step_times) // 2]},
            learnt,
        )
    await comm.close()


def report(
    args: argparse.Namespace,
    events: Events,
    history: list[tuple[int, float, int]],
    digests: list[str],
    world_size: int,
    extra: dict[str, float],
    learnt: tuple[float, float],
) -> None:
    marks = events.read()
    same = len(set(digests)) == 1
    print(f"final loss {history[-1][1]:.5f} after {len(history)} steps (first {history[0][1]:.5f})")
    print(f"held-out loss {learnt[1]:.5f} (at the start {learnt[0]:.5f})")
    print(f"parameters bit-equal on all {world_size} ranks: {same}  (sha256 {digests[0]})")
    zero = marks["death"][0] if "death" in marks else T0
    print("timeline (seconds after the death):")
    for name, (at, detail) in sorted(marks.items(), key=lambda kv: kv[1][0]):
        print(f"  {at - zero:+8.3f}  {name:<20} {detail}")
    summary = {name: at for name, (at, _) in marks.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "mode": args.mode,
                    "events": marks,
                    "bit_equal": same,
                    "history": history,
                    **extra,
                },
                f,
            )
    if {"death", "first joint step", "replacement started"} <= set(summary):
        print(
            f"replacement start -> first joint step: {summary['first joint step'] - summary['replacement started']:.3f} s"
        )
    if args.png:
        plot(args.png, history, summary)


def plot(path: str, history: list[tuple[int, float, int]], marks: dict[str, float]) -> None:
    try:
        import matplotlib
    except ImportError:
        print("no PNG: matplotlib is not installed")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s, _, _ in history]
    losses = [loss for _, loss, _ in history]
    smooth = [
        sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1])
        for i in range(len(losses))
    ]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
    top.plot(steps, losses, alpha=0.35, label="rank 0's shard")
    top.plot(steps, smooth, label="mean of the last 10 steps")
    top.set_yscale("log")
    top.set_ylabel("loss")
    top.legend(loc="upper right")
    changes = [s for (s, _, n), (_, _, m) in zip(history, history[1:]) if n != m]
    for ax in (top, bottom):
        for s in changes:
            ax.axvline(s + 1, color="grey", linestyle="--", linewidth=0.8)
    bottom.step(steps, [n for _, _, n in history], where="post")
    bottom.set_ylabel("world size")
    bottom.set_xlabel("step")
    bottom.set_yticks(sorted({n for _, _, n in history}))
    fig.suptitle("asynccoll elastic: a rank dies, the survivors shrink, its replacement joins")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


# ---------------------------------------------------------------------- launcher
def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", *args]


def launch(args: argparse.Namespace, passthrough: list[str]) -> int:
    """Start the store and the torchruns, wait for them, stop the store; 0 when all finished."""
    store = subprocess.Popen(
        [sys.executable, "-m", "asynccoll.store", "--port", "0", "--host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert store.stdout is not None
    line = store.stdout.readline()  # "asynccoll store: listening on HOST:PORT"
    if not line.startswith("asynccoll store: listening on "):
        store.kill()
        raise SystemExit(f"the store did not start: {line!r}")
    address = line.rsplit(" ", 1)[1].strip()
    script = os.path.abspath(__file__)
    common = [*passthrough, "--store", address]
    if args.mode == "elastic":
        jobs = [
            torchrun(
                "--nproc-per-node",
                "1",
                "--max-restarts",
                "3",
                script,
                "--rank",
                str(r),
                "--world-size",
                str(args.world_size),
                *common,
            )
            for r in range(args.world_size)
        ]
    else:
        jobs = [
            torchrun(
                "--nproc-per-node", str(args.world_size), "--max-restarts", "1", script, *common
            )
        ]
    procs = [subprocess.Popen(job) for job in jobs]
    deadline = time.monotonic() + args.deadline
    try:
        for p in procs:
            p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"launcher: not finished after {args.deadline} s; stopping", flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()  # torchrun stops its workers
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        store.send_signal(signal.SIGTERM)
        store.wait(10)
    return max(abs(p.returncode or 0) for p in procs)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--mode", choices=["elastic", "torchrun"], default="elastic")
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument(
        "--rank", type=int, default=None, help="(worker) this rank, given by the launcher"
    )
    ap.add_argument("--store", default=None, help="(worker) HOST:PORT of the external store")
    ap.add_argument(
        "--deadline", type=float, default=150.0, help="(launcher) stop everything after this"
    )
    ap.add_argument(
        "--steps", type=int, default=40, help="at least this many steps, and 5 after a rejoin"
    )
    ap.add_argument(
        "--max-steps", type=int, default=2000, help="stop here even if no replacement came back"
    )
    ap.add_argument(
        "--step-time", type=float, default=0.02, help="seconds of simulated data loading per step"
    )
    ap.add_argument("--kill-rank", type=int, default=2)
    ap.add_argument("--kill-step", type=int, default=10)
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument(
        "--batch", type=int, default=96, help="global batch (divisible by the world sizes)"
    )
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--png", default=os.path.join(tempfile.gettempdir(), "asynccoll-elastic.png"))
    ap.add_argument(
        "--json", default=None, help="write the timeline and history here (bench/elastic.py)"
    )
    ap.add_argument(
        "--checkpoint", default=os.path.join(tempfile.gettempdir(), "asynccoll-elastic.ckpt")
    )
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=5,
        help="(--mode torchrun) steps between checkpoints",
    )
    return ap.parse_args(argv)


if __name__ == "__main__":
    parsed = parse()
    if parsed.store is not None:  # a worker, started by torchrun
        asyncio.run(worker(parsed))
    else:  # the workers get the same arguments, and where they are
        raise SystemExit(launch(parsed, sys.argv[1:]))
