"""KvpollConnector and NixlConnector with the connector calls on vLLM's
step path timed, for bench_step_serve.py: ``build_connector_meta`` (the
scheduler's), ``start_load_kv`` and ``get_transfer_results`` (the worker's: what
vLLM's model runner calls each step; it calls ``get_finished``).
Each process appends ``monotonic_s call seconds`` lines to a file of its
own in ``$KVPOLL_STEP_TIMES``; without it nothing is recorded. Named in
``--kv-transfer-config`` as ``{"kv_connector": "TimedKvpollConnector",
"kv_connector_module_path": "timed_connector"}`` with this folder on
``PYTHONPATH``."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, List, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from kvpoll.vllm import KvpollConnector

_OUT = os.environ.get("KVPOLL_STEP_TIMES")
_lock = threading.Lock()
_buf: List[Tuple[float, str, float]] = []
_flushed = [time.monotonic()]


def _record(call: str, seconds: float) -> None:
    if not _OUT:
        return
    now = time.monotonic()
    with _lock:
        _buf.append((now, call, seconds))
        if now - _flushed[0] < 0.5:
            return
        lines, _buf[:] = list(_buf), []
        _flushed[0] = now
    with open(os.path.join(_OUT, f"times-{os.getpid()}.txt"), "a") as f:
        f.writelines(f"{t:.6f} {c} {s:.9f}\n" for t, c, s in lines)


def _timed_call(call: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        _record(call, time.perf_counter() - t0)


def _timed(cls: Any) -> Any:
    class Timed(cls):  # type: ignore[misc, valid-type]
        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return _timed_call("build_connector_meta", super().build_connector_meta, scheduler_output)

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            return _timed_call("start_load_kv", super().start_load_kv, forward_context, **kwargs)

        def get_transfer_results(self, finished_req_ids: Any) -> Any:
            return _timed_call("get_transfer_results", super().get_transfer_results, finished_req_ids)

    Timed.__name__ = Timed.__qualname__ = f"Timed{cls.__name__}"
    return Timed


TimedKvpollConnector = _timed(KvpollConnector)
TimedNixlConnector = _timed(NixlConnector)
