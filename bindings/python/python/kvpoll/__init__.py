"""kvpoll: KV-cache block transfers between prefill and decode engines over
UCX, each request reported exactly once.

The engine (``Engine``) is the Rust library's, wrapped as it is: submit
``read`` / ``write`` / ``lend``, then call ``poll()`` every engine step.
``kvpoll.connector`` is a worker-side connector core with the method names
and shapes of vLLM's KV-connector worker API, on top of it, and
``kvpoll.vllm`` the vLLM connector built on that (it needs vLLM).

Request ids are ``str`` or ``int``: reports give back the same objects.
Errors are ``KvpollError`` subclasses carrying the engine's message; bad
arguments raise ``TypeError`` or ``ValueError``.
"""

try:
    # The UCX of the libucx wheel (a dependency of kvpoll's wheel), loaded
    # before the extension so that its libucp is the one the extension
    # binds to (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true prefers the
    # system's). Without the wheel, the extension's own rpath or the system
    # library path decide.
    import libucx as _libucx
except ImportError:
    pass
else:
    _libucx.load_library()

from ._kvpoll import (
    BusyError,
    ConfigError,
    Engine,
    KvpollError,
    PeerError,
    PollResult,
    RegionError,
    RequestError,
    ShutdownError,
    Transfer,
    TransportError,
    device_memory,
    draw_incarnation,
    request_id,
    ucx_version,
)

__all__ = [
    "BusyError",
    "ConfigError",
    "Engine",
    "KvpollError",
    "PeerError",
    "PollResult",
    "RegionError",
    "RequestError",
    "ShutdownError",
    "Transfer",
    "TransportError",
    "device_memory",
    "draw_incarnation",
    "request_id",
    "ucx_version",
]
