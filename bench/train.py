"""Training-step benchmark: GradSync vs torch DDP vs the naive coalesced loop, same processes.

    python -m bench.train [--quick] [--json bench/results/train.json] [--plot bench/results/train.png]

Two Gloo ranks on this machine (CPU) per variant: each variant runs in processes
of its own (as a user's job would: see ``_Team`` for what sharing a process hid),
and each of its ranks builds a torch.distributed group and an asynccoll
communicator on a TCPStore of its own, and its copy of the model (same initial
weights, same batches everywhere):

* ``ddp``: ``DistributedDataParallel`` (defaults: 25 MiB buckets, 1 MiB first);
* ``gradsync``: ``loss.backward(); await sync.wait()`` with ``ac.GradSync``;
* ``*_thread``: the same with ``await asyncio.to_thread(loss.backward)``
  (``ddp_thread``, ``gradsync_thread``);
* ``*@MB``: every bucket of that size (DDP's ``bucket_cap_mb``, which in torch
  2.13 sizes its first bucket too; GradSync's ``bucket_mb`` and
  ``first_bucket_mb``), e.g. ``ddp@4`` and ``gradsync@4`` compare them at equal
  sizes (each row's ``buckets_as_vs`` says whether the sizes really agree);
* ``naive``: ``loss.backward()`` then every ``p.grad`` all-reduced (AVG) in one
  ``comm.coalescing()`` block, as a new user would write it;
* ``local``: no communication at all (the floor of any synchronised step);
* ``flat``: the step of ``local`` plus ONE blocking torch ``all_reduce`` of a flat
  buffer as large as all the gradients (nothing copied into it, nothing overlapped
  with backward): the same compute and the same bytes reduced, done one after the
  other. Its parameters are not synchronised (like ``local``).

A step is forward, backward, gradient sync, ``SGD(momentum=0.9).step()`` and
``zero_grad()``. Variants run in blocks of ``--steps`` steps, one variant's
processes at a time (the others wait idle), alternating (``ddp, gradsync, ...,
ddp, gradsync, ...``, the order rotated every round) so that the machine's noise
hits all alike; reported: the median step time of each
variant over all its blocks' steps (and the median CPU time of the rank-0 process,
every thread, per step: less sensitive to a loaded machine; and its minor page faults
per step: memory the kernel had to map in again), and its ratio to the DDP variant of the same
backward style and bucket size (``ddp`` when there is none). At the end every
synchronising variant must hold the same parameters (they trained on the same
data): checked.

Backward in a thread: the loop's default executor is given threads that call
``torch.set_num_threads(--threads)`` first. Without that, a fresh thread's first
matmul runs MKL with its default team (the CPU count) while the main thread was
limited to one: measured here, backward in ``asyncio.to_thread`` then spun in
libgomp for hundreds of ms per step on the loaded 2-core machine, for DDP and
GradSync alike.

Models: ``mlp``: 6 x Linear(1024, 1024) + ReLU, batch 32; ``small``: 100 x
Linear(128, 128) + ReLU, batch 32.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import machine, store_server

MODELS = {"mlp": (6, 1024), "small": (100, 128)}
BATCH = 32


def _model(layers: int, width: int) -> Any:
    import torch

    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def _batch(rank: int, step: int, width: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    return torch.randn(BATCH, width, generator=g), torch.randn(BATCH, width, generator=g)


def _kind(name: str) -> tuple[str, bool, float | None]:
    """``"gradsync_thread@4"`` -> ("gradsync", True, 4.0): the sync, backward in a thread, bucket MiB."""
    base, _, mb = name.partition("@")
    thread = base.endswith("_thread")
    return base.removesuffix("_thread"), thread, float(mb) if mb else None


def _same_buckets(a: list[float] | None, b: list[float] | None) -> bool | None:
    """Whether two variants reduce in buckets of the same sizes (order aside; None: unknown)."""
    if a is None or b is None:
        return None
    return sorted(round(x, 2) for x in a) == sorted(round(x, 2) for x in b)


def _reference(name: str, names: list[str]) -> str:
    """The DDP variant ``name`` is compared with: same backward style and bucket size, else ``ddp``."""
    _, thread, mb = _kind(name)
    ref = "ddp" + ("_thread" if thread else "") + (f"@{mb:g}" if mb is not None else "")
    return ref if ref in names else "ddp"


class _Variant:
    """One model copy, its optimizer and its way of synchronising gradients."""

    def __init__(
        self, name: str, base: Any, comm: Any, bucket_mb: float, first_bucket_mb: float
    ) -> None:
        import copy

        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        import asynccoll as ac

        self.name = name
        self.kind, self.thread, mb = _kind(name)
        self.model = copy.deepcopy(base)
        self.comm = comm
        self.forward = self.model
        self.sync: Any = None
        self.ddp: Any = None
        if self.kind == "ddp":
            self.forward = self.ddp = (
                DDP(self.model, bucket_cap_mb=mb) if mb is not None else DDP(self.model)
            )
        elif self.kind.startswith("gradsync"):
            # At an explicit size both sides use it for every bucket: DDP given
            # ``bucket_cap_mb`` makes its first bucket that size too (torch 2.13,
            # ``nn/parallel/distributed.py``: ``first_bucket_bytes_cap = ... if
            # is_using_default else bucket_bytes_cap``), so GradSync's first is as well.
            self.sync = ac.GradSync(
                comm,
                self.model,
                bucket_mb=mb if mb is not None else bucket_mb,
                first_bucket_mb=mb if mb is not None else first_bucket_mb,
            )
        self.params = list(self.model.parameters())
        self.flat = (
            torch.zeros(sum(p.numel() for p in self.params)) if self.kind == "flat" else None
        )
        if self.kind in ("local", "flat"):
            # A block as large as the gradients, freed: what DDP's bucket rebuild frees
            # after its first step (GradSync frees one when it builds its buckets), and
            # what keeps glibc from handing the step's gradients back to the kernel each
            # step (``_Team``). Without it the floors paged 4 MiB of gradients in again
            # every step (992 faults).
            torch.ones(sum(p.numel() for p in self.params))
        self.opt = torch.optim.SGD(self.params, lr=1e-3, momentum=0.9)
        self.times: list[float] = []
        self.cpu: list[float] = []  # this process's CPU time per step, every thread
        self.faults: list[int] = []  # this process's minor page faults per step (memory paged in)

    def bucket_mb(self, final: bool = False) -> list[float] | None:
        """The bucket sizes in use (MiB), in reduction order where known (``final``:
        None while DDP still has its construction-time buckets)."""
        if self.sync is not None:
            return [b / 2**20 for b in self.sync.bucket_sizes]
        if self.ddp is not None:
            data = self.ddp._get_ddp_logging_data()
            # After its first step DDP rebuilds its buckets in gradient-ready order;
            # "bucket_sizes" keeps the construction-time ones (measured: one 24 MiB
            # bucket for 6 x Linear(1024) at bucket_cap_mb=4, then six of 4 MiB).
            sizes = data.get("rebuilt_bucket_sizes", None if final else data.get("bucket_sizes"))
            if isinstance(sizes, str):  # torch logs them as "a, b, ..." (bytes)
                return [int(x) / 2**20 for x in sizes.split(",") if x.strip()]
        return None

    async def step(self, x: Any, y: Any) -> None:
        import torch

        import asynccoll as ac

        loss = torch.nn.functional.mse_loss(self.forward(x), y)
        if self.thread:
            await asyncio.to_thread(loss.backward)
        else:
            loss.backward()
        if self.kind == "gradsync_opt":
            await self.sync.wait(self.opt)  # optimizer stepped bucket by bucket
            self.opt.zero_grad()
            return
        if self.sync is not None:
            await self.sync.wait()
        elif self.flat is not None:
            torch.distributed.all_reduce(self.flat)
        elif self.name == "naive":
            async with self.comm.coalescing():
                for p in self.params:
                    self.comm.all_reduce(p.grad, ac.ReduceOp.AVG)
        self.opt.step()
        self.opt.zero_grad()


async def _team_rank(
    rank: int, world_size: int, port: int, name: str, args: argparse.Namespace, conn: Any
) -> None:
    """One rank of one variant's processes: build, warm up, run blocks, on the driver's word."""
    import torch
    import torch.distributed as dist

    import asynccoll as ac

    torch.set_num_threads(args.threads)
    loop = asyncio.get_running_loop()
    # Threads for asyncio.to_thread(loss.backward) with the same torch thread count (module docstring).
    loop.set_default_executor(
        concurrent.futures.ThreadPoolExecutor(
            2, initializer=torch.set_num_threads, initargs=(args.threads,)
        )
    )
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("torch/", store), rank=rank, world_size=world_size
    )
    comm = await ac.init(
        "gloo", rank=rank, world_size=world_size, store=dist.PrefixStore("ac/", store)
    )
    listener = concurrent.futures.ThreadPoolExecutor(1)  # the driver's pipe, read off the loop
    variant: _Variant | None = None
    width = step_no = 0
    try:
        while True:
            cmd, arg = await loop.run_in_executor(listener, conn.recv)
            reply: Any = None
            if cmd == "model":  # build this variant of the model (same seed everywhere), warm up
                if variant is not None and variant.sync is not None:
                    variant.sync.close()
                layers, width = MODELS[arg]
                torch.manual_seed(0)
                variant = _Variant(
                    name, _model(layers, width), comm, args.bucket_mb, args.first_bucket_mb
                )
                for step_no in range(
                    args.warmup
                ):  # (DDP rebuilds its buckets after its first step)
                    await variant.step(*_batch(comm.rank, step_no, width))
                step_no = args.warmup
            elif cmd == "block":
                assert variant is not None
                await comm.barrier()
                for _ in range(args.steps):
                    x, y = _batch(comm.rank, step_no, width)
                    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    c0, t0 = time.process_time(), time.perf_counter()
                    await variant.step(x, y)
                    variant.times.append(time.perf_counter() - t0)
                    variant.cpu.append(time.process_time() - c0)
                    variant.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                    step_no += 1
            elif cmd == "result":
                assert variant is not None
                reply = {
                    "times": variant.times,
                    "cpu": variant.cpu,
                    "faults": variant.faults,
                    "buckets_mb": variant.bucket_mb(),
                    "final_buckets_mb": variant.bucket_mb(final=True),
                    "params": [p.detach().clone() for p in variant.params] if rank == 0 else None,
                }
            elif cmd == "exit":
                break
            conn.send(("ok", reply))
    finally:
        if variant is not None and variant.sync is not None:
            variant.sync.close()
        listener.shutdown(wait=False)
        await comm.close()
        dist.destroy_process_group()
    # Closed; every rank exits on the driver's word, once all have closed.
    conn.send(("ok", None))
    if conn.poll(60):
        conn.recv()


def _team_entry(
    rank: int, world_size: int, port: int, name: str, args: argparse.Namespace, conn: Any
) -> None:
    try:
        if args.loop == "uvloop":
            import uvloop

            uvloop.run(_team_rank(rank, world_size, port, name, args, conn))
        else:
            asyncio.run(_team_rank(rank, world_size, port, name, args, conn))
    except BaseException as exc:
        import traceback

        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from exc


class _Team:
    """The processes of one variant (one per rank, a store of their own), driven over pipes.

    Each variant runs in processes of its own, as a user's job would: a process's
    allocator state is shared by everything in it, and measured here it decides
    whole milliseconds of a step. DDP frees its construction-time bucket (24 MiB for
    6 x Linear(1024)) when it rebuilds its buckets, which raises glibc's mmap and
    trim thresholds for the whole process; every variant in the same process then
    stopped paging its gradients in each step, DDP's neighbours included. (GradSync
    frees one block of its buckets' size before allocating them, to the same end.)
    """

    def __init__(self, ctx: Any, name: str, args: argparse.Namespace, world_size: int) -> None:
        self.name = name
        self.server = store_server()  # this variant's store, for its ranks only
        port = self.server.port
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_team_entry, args=(r, world_size, port, name, args, child), daemon=True
            )
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def send(self, cmd: str, arg: Any = None) -> None:
        for conn in self.conns:
            conn.send((cmd, arg))

    def collect(self) -> Any:
        """Every rank's reply to the last command; rank 0's."""
        replies = []
        for r, conn in enumerate(self.conns):
            if not conn.poll(600):
                raise TimeoutError(f"{self.name}: rank {r} did not answer in 10 minutes")
            status, payload = conn.recv()
            if status != "ok":
                raise RuntimeError(f"{self.name}: rank {r} failed:\n{payload}")
            replies.append(payload)
        return replies[0]

    def ask(self, cmd: str, arg: Any = None) -> Any:
        self.send(cmd, arg)
        return self.collect()

    def close(self) -> None:
        """Every rank closes its communicator, then all exit; then the store goes."""
        try:
            self.ask("exit")
            self.send("bye")
        except (OSError, EOFError, RuntimeError, TimeoutError):
            pass  # a rank that failed: its error was raised already; kill below
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        self.server = None


def _bench_model(teams: list[_Team], model: str, args: argparse.Namespace) -> dict[str, Any]:
    layers, width = MODELS[model]
    for team in teams:  # build and warm up every variant (concurrently: warm-up is not timed)
        team.send("model", model)
    for team in teams:
        team.collect()
    for rnd in range(args.rounds):  # one variant's block at a time, the others idle
        k = rnd % len(teams)
        for team in teams[k:] + teams[:k]:
            team.ask("block")
    got = {team.name: team.ask("result") for team in teams}
    # Same data, same number of steps: every synchronising variant ends with the same parameters.
    synced = [n for n in got if _kind(n)[0] not in ("local", "flat")]
    worst = 0.0
    for n in synced[1:]:
        for a, b in zip(got[n]["params"], got[synced[0]]["params"]):
            worst = max(worst, float((a - b).abs().max()))
    if worst > 1e-4:
        raise AssertionError(f"{model}: variants disagree after training (max |diff| {worst})")
    names = list(got)
    med = {n: statistics.median(got[n]["times"]) for n in names}
    p10 = {n: sorted(got[n]["times"])[len(got[n]["times"]) // 10] for n in names}
    cpu = {n: statistics.median(got[n]["cpu"]) for n in names}
    rows = {}
    for n in names:
        ref_name = _reference(n, names)
        rows[n] = {
            "median_ms": med[n] * 1e3,
            "p10_ms": p10[n] * 1e3,
            "mean_ms": statistics.fmean(got[n]["times"]) * 1e3,
            "vs": ref_name,
            "ratio_vs_ddp": med[n] / med[ref_name],
            "ratio_vs_ddp_p10": p10[n] / p10[ref_name],
            "cpu_ms": cpu[n] * 1e3,
            "cpu_ratio_vs_ddp": cpu[n] / cpu[ref_name],
            "page_faults": statistics.median(got[n]["faults"]),
            "steps": len(got[n]["times"]),
            "buckets_mb": got[n]["buckets_mb"],
            "buckets_as_vs": None
            if ref_name == n
            else _same_buckets(got[n]["final_buckets_mb"], got[ref_name]["final_buckets_mb"]),
            "times_ms": [t * 1e3 for t in got[n]["times"]],
        }
    sync_buckets = next(
        (got[n]["buckets_mb"] for n in names if _kind(n)[0].startswith("gradsync")), None
    )
    return {
        "model": model,
        "layers": layers,
        "width": width,
        "batch": BATCH,
        "params_mb": sum(p.numel() for p in got[names[0]]["params"]) * 4 / 2**20,
        "gradsync_buckets_mb": sync_buckets,
        "max_param_diff": worst,
        "variants": rows,
    }


def run(args: argparse.Namespace, world_size: int = 2) -> dict[str, Any]:
    """Spawn each variant's ranks, run the benchmark, return the results (rank 0's timings)."""
    before = machine()
    # Every rank process forks from one server that imported torch once: 2 x 9 fresh
    # interpreters importing torch would take longer than a quick run's steps.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel", "asynccoll"])
    teams: list[_Team] = []
    try:
        for name in args.variants:
            teams.append(_Team(ctx, name, args, world_size))
        models = [_bench_model(teams, m, args) for m in args.models]
    finally:
        for team in teams:
            team.close()
    config = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    return {
        "world_size": world_size,
        "cpus": os.cpu_count(),
        "machine": before,
        "machine_after": machine(),
        "config": config,
        "process_per_variant": True,
        "models": models,
    }


def _table(res: dict[str, Any]) -> str:
    lines = []
    for m in res["models"]:
        buckets = ", ".join(f"{b:.1f}" for b in m["gradsync_buckets_mb"] or [])
        lines.append(
            f"{m['model']}: {m['layers']} x Linear({m['width']}), {m['params_mb']:.1f} MiB of parameters, "
            f"batch {m['batch']}; GradSync buckets (MiB): {buckets}"
        )
        lines.append(
            f"  {'variant':<20} {'median ms':>10} {'p10 ms':>8} {'vs':>12} {'ratio':>7} {'p10':>7} "
            f"{'cpu ms':>7} {'cpu r':>6} {'faults':>7} {'steps':>6}"
        )
        for name, row in m["variants"].items():
            lines.append(
                f"  {name:<20} {row['median_ms']:>10.2f} {row['p10_ms']:>8.2f} {row['vs']:>12} "
                f"{row['ratio_vs_ddp']:>7.3f} {row['ratio_vs_ddp_p10']:>7.3f} {row['cpu_ms']:>7.2f} "
                f"{row['cpu_ratio_vs_ddp']:>6.3f} {row['page_faults']:>7.0f} {row['steps']:>6}"
            )
        for name, row in m["variants"].items():
            if row["buckets_mb"]:
                same = {True: f" (as {row['vs']})", False: f" (NOT as {row['vs']})"}.get(
                    row.get("buckets_as_vs"), ""
                )
                lines.append(
                    f"  buckets of {name} (MiB): "
                    + ", ".join(f"{b:.1f}" for b in row["buckets_mb"])
                    + same
                )
        lines.append(
            f"  final parameters agree across variants (max |diff| {m['max_param_diff']:.1e})"
        )
    return "\n".join(lines)


def _plot(res: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = res["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        names = list(m["variants"])
        data = [m["variants"][n]["times_ms"] for n in names]
        ax.boxplot(data, showfliers=False)
        ax.set_xticks(range(1, len(names) + 1), names, rotation=15)
        for i, n in enumerate(names, start=1):
            ax.annotate(
                f"{m['variants'][n]['ratio_vs_ddp']:.2f}x",
                (i, m["variants"][n]["median_ms"]),
                textcoords="offset points",
                xytext=(14, 0),
                fontsize=8,
            )
        ax.set_title(f"{m['model']}: {m['layers']} x Linear({m['width']}), batch {m['batch']}")
        ax.set_ylabel("step time (ms)")
    fig.suptitle(f"Training step, {res['world_size']} Gloo ranks, CPU (median ratio vs DDP)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: few rounds")
    ap.add_argument("--rounds", type=int, default=30, help="rounds of alternating blocks")
    ap.add_argument("--steps", type=int, default=4, help="steps per block")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mlp", "small"])
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["ddp", "gradsync", "ddp_thread", "gradsync_thread", "local"],
        help="ddp, gradsync, gradsync_opt (wait(opt)), naive, local, flat; _thread: backward in a thread; "
        "@MB: bucket size (ddp@4 gradsync@4)",
    )
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--first-bucket-mb", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--json", default="bench/results/train.json")
    ap.add_argument("--plot", default="bench/results/train.png")
    args = ap.parse_args(argv)
    if "ddp" not in args.variants:
        ap.error("--variants must include ddp (the reference)")
    bad = [
        v
        for v in args.variants
        if _kind(v)[0] not in ("ddp", "gradsync", "gradsync_opt", "naive", "local", "flat")
    ]
    if bad:
        ap.error(f"unknown variants: {bad}")
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 3, 1
    res = run(args)
    print(_table(res))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {path}")
    if _plot(res, Path(args.plot)):
        print(f"wrote {args.plot}")
    else:
        print("matplotlib is not installed: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
