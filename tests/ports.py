"""A free loopback port for a server a test starts.

A port the kernel hands out for ``bind(0)`` lies in its ephemeral range, which every
outgoing connection draws from too (gloo's between ranks, HTTP clients'): in the seconds a
server takes to load a model, one of them may take it ("Address already in use"). The
ports here lie below that range, drawn at random so that parallel test workers rarely
pick the same one, and are checked free when drawn."""
import random
import socket
from pathlib import Path


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    top = _ephemeral_start()
    low = max(1024, top - 12000) if top > 2048 else 49152
    high = top if top > 2048 else 65535
    for _ in range(100):
        port = random.randrange(low, high)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free loopback port in [{low}, {high})")
