"""A free TCP port on 127.0.0.1 for a test's server (the default 8000 may be taken by anything on the machine)."""

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
