"""A port for a test to hand to ranks that bind it later (``master_port``).

A port the kernel gave to ``bind(("127.0.0.1", 0))`` is an ephemeral one: any
connection another test opens meanwhile (Gloo opens many) may get it as its local
port before the rank binds it. Ports below the kernel's ephemeral range are only
ever taken by someone binding them by number, so one free now stays free.
"""

from __future__ import annotations

import random
import socket

_FALLBACK_LOW = 32768  # Linux's default ephemeral range starts here


def unused_port() -> int:
    """A port free now, outside the ephemeral range where possible."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10000, low) if low > 11000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free port below the ephemeral range")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_LOW
