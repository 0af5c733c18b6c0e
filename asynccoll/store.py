"""``python -m asynccoll.store [--port PORT]``: serve a rendezvous store that outlives every rank.

This is torch's own ``TCPStore`` (the libuv server), run in a process of its own
until SIGINT or SIGTERM; it is not a store of asynccoll's. Use it when ranks are
launched independently of one another — one ``torchrun`` per rank, one Slurm step
per rank, ranks restarted on their own — so that no rank hosts the store (a rank
that hosts it takes the store down with it when it dies, and with it every rank's
liveness and ``shrink()``). Under a single ``torchrun --nproc-per-node N`` the agent
already hosts the store; there you do not need this.

Ranks connect as clients: ``ac.init(..., master_addr=HOST, master_port=PORT)``
under torchrun (whose agent store makes every rank a client), or
``store=torch.distributed.TCPStore(HOST, PORT, is_master=False)``, and
``ac.join(..., master_addr=HOST, master_port=PORT)`` (always a client).

The first line on stdout is ``asynccoll store: listening on HOST:PORT`` (with
``--port 0``, the port the system picked). The server listens on every interface
(as any TCPStore does): anyone who reaches the port can read and write it, so run it
on a private network.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from datetime import timedelta

import torch.distributed as dist


def serve(host: str, port: int) -> dist.TCPStore:
    """Start the server (torch's libuv TCPStore) and return it."""
    return dist.TCPStore(
        host, port, 1, True, timeout=timedelta(seconds=60), wait_for_workers=False, use_libuv=True
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asynccoll.store",
        description="Serve torch's TCPStore (libuv) until SIGINT/SIGTERM: a rendezvous store that outlives every rank.",
    )
    parser.add_argument(
        "--port", type=int, default=29500, help="TCP port (0: pick a free one; default 29500)"
    )
    parser.add_argument(
        "--host",
        default=socket.gethostname(),
        help="the address ranks should use, as printed (the server listens on every interface)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        store = serve(args.host, args.port)
    except (dist.DistError, RuntimeError) as exc:  # DistNetworkError: the port is taken
        print(
            f"asynccoll store: cannot listen on port {args.port}: {str(exc).splitlines()[0]}",
            file=sys.stderr,
        )
        return 1
    print(f"asynccoll store: listening on {args.host}:{store.port}", flush=True)
    while not stop.wait(1.0):
        pass
    print("asynccoll store: stopped", flush=True)
    del store
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
