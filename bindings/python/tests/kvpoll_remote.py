"""A kvpoll engine in another process, driven over a pipe.

``Remote(seed=1)`` spawns a process (the ``spawn`` start method: no fork of
a process with UCX threads) that builds an engine, registers its regions,
fills every block with ``pattern(seed, region, block)`` and sends back its
metadata. Then it serves calls: ``remote.call("lend", ...)`` runs
``engine.lend(...)`` there, ``remote.wait("finished_sending", id)`` polls
there until the id was reported, and every report is kept, so a test can
check that a request was reported exactly once. ``remote.pid`` is for
SIGSTOP, SIGCONT and SIGKILL.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
from typing import Any, Dict, Iterator, List

BS = 4096
BLOCKS = 64
REGIONS = 2
GUARD_S = 30.0


def pattern(seed: int, region: int, block: int) -> bytes:
    """The bytes of a block: distinct for every (seed, region, block)."""
    digest = hashlib.blake2b(f"{seed}:{region}:{block}".encode(), digest_size=64).digest()
    return digest * (BS // len(digest))


def fill(engine: Any, seed: int) -> None:
    for r in range(REGIONS):
        for b in range(BLOCKS):
            engine.write_block(r, b, pattern(seed, r, b))


def new_engine(**kwargs: Any) -> Any:
    import kvpoll

    args = dict(block_size=BS, tls="tcp", idle="adaptive")
    args.update(kwargs)
    e = kvpoll.Engine(**args)
    for _ in range(REGIONS):
        e.register(BLOCKS)
    return e


class Reports:
    """Every report of one engine, in order, kept for the engine's life."""

    FIELDS = (
        "finished_recving",
        "finished_sending",
        "expired",
        "failed_recving",
        "failed_sending",
        "handle_failures",
    )

    def __init__(self) -> None:
        self.finished_recving: List[Any] = []
        self.finished_sending: List[Any] = []
        self.expired: List[Any] = []
        self.failed_sending: List[Any] = []
        self.failed_recving: List[Any] = []  # (id, blocks, (cause, status))
        self.handle_failures: List[Any] = []  # (id, handle, cause, status)

    def add(self, r: Any) -> None:
        if not r:
            return
        self.finished_recving += r.finished_recving
        self.finished_sending += r.finished_sending
        self.expired += r.expired
        self.failed_sending += list(r.failed_sending.items())
        reasons = r.failure_reasons
        for i, blocks in r.failed_recving.items():
            self.failed_recving.append((i, blocks, reasons[i]))
        self.handle_failures += r.handle_failures

    def ids(self, field: str) -> List[Any]:
        items = getattr(self, field)
        if field in ("failed_recving", "failed_sending", "handle_failures"):
            return [x[0] for x in items]
        return list(items)

    def as_dict(self) -> Dict[str, List[Any]]:
        return {f: list(getattr(self, f)) for f in self.FIELDS}


def poll_until(engine: Any, reports: Reports, field: str, req_id: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while True:
        reports.add(engine.poll())
        if req_id in reports.ids(field):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.001)


def poll_for(engine: Any, reports: Reports, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        reports.add(engine.poll())
        time.sleep(0.002)


def producer_loop(engine: Any, ids: List[Any], batch: int, lease_s: float, timeout: float) -> Dict[str, Any]:
    """A prefill worker's scheduler loop over the connector core: lends one
    block per request (``ids``: (n, request id, incarnation drawn by the
    test and handed to the reader first)) in batches (each batch passed as finished the same
    step, as vLLM's scheduler does at the end of prefill) and calls
    get_finished every step until every id came back. Returns how many
    times each id was seen in ``sending`` and ``recving``."""
    from kvpoll.connector import KvConnectorWorker

    worker = KvConnectorWorker(engine=engine, lease_s=lease_s)
    sending: Dict[Any, int] = {}
    recving: Dict[Any, int] = {}
    end = time.monotonic() + timeout
    next_i = 0
    while time.monotonic() < end:
        finished: List[Any] = []
        if next_i < len(ids):
            chunk = ids[next_i : next_i + batch]
            next_i += len(chunk)
            worker.start_load_kv(reqs_to_send={i: ([n % BLOCKS], 1, inc) for n, i, inc in chunk})
            finished = [i for _, i, _ in chunk]
        s, r = worker.get_finished(finished)
        for i in s or ():
            sending[i] = sending.get(i, 0) + 1
        for i in r or ():
            recving[i] = recving.get(i, 0) + 1
        if next_i >= len(ids) and len(sending) >= len(ids):
            # A few more steps: anything reported twice would show now.
            for _ in range(20):
                s, r = worker.get_finished(())
                for i in s or ():
                    sending[i] = sending.get(i, 0) + 1
                time.sleep(0.001)
            break
        time.sleep(0.0005)
    return {"sending": sending, "recving": recving, "pending": worker.pending}


def messages(conn: Any) -> Iterator[Any]:
    """What arrives on a pipe, until the other end closes it."""
    while True:
        try:
            yield conn.recv()
        except EOFError:
            return


def _serve(conn: Any, seed: int, engine_kwargs: Dict[str, Any]) -> None:
    try:
        engine = new_engine(**engine_kwargs)
        fill(engine, seed)
        conn.send(("ready", engine.local_metadata()))
    except Exception as e:  # reported to the test, which fails
        conn.send(("err", type(e).__name__, str(e)))
        return
    reports = Reports()
    for msg in messages(conn):
        op = msg[0]
        try:
            if op == "call":
                _, name, args, kwargs = msg
                conn.send(("ok", getattr(engine, name)(*args, **kwargs)))
            elif op == "wait":
                _, field, req_id, timeout = msg
                found = poll_until(engine, reports, field, req_id, timeout)
                conn.send(("ok", (found, reports.as_dict())))
            elif op == "poll_for":
                poll_for(engine, reports, msg[1])
                conn.send(("ok", reports.as_dict()))
            elif op == "producer_loop":
                conn.send(("ok", producer_loop(engine, *msg[1:])))
            elif op == "exit":
                engine.shutdown()
                conn.send(("ok", None))
                break
            else:
                conn.send(("err", "ValueError", f"unknown op {op!r}"))
        except Exception as e:
            conn.send(("err", type(e).__name__, str(e)))


class RemoteError(Exception):
    """An exception raised in the remote process: (class name, message)."""


class Child:
    """A process of its own (spawned: no fork of a process with UCX
    threads), asked over a pipe: it answers ("ok", value) or ("err", class
    name, message), and leaves on ("exit",)."""

    def __init__(self, target: Any, *args: Any, daemon: bool = True) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=daemon)
        self.proc.start()
        child.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _ask(self, *msg: Any, timeout: float = 120.0) -> Any:
        self.conn.send(msg)
        return self.answer(timeout)

    def answer(self, timeout: float = 120.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer from {type(self).__name__} (pid {self.pid})")
        reply = self.conn.recv()
        if reply[0] == "err":
            raise RemoteError(reply[1], reply[2])
        return reply[1]

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._ask("exit", timeout=30)
            except (OSError, EOFError, TimeoutError, RemoteError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()


class Remote(Child):
    """A producer (or any engine) in its own process."""

    def __init__(self, seed: int, **engine_kwargs: Any) -> None:
        super().__init__(_serve, seed, engine_kwargs)
        self.seed = seed
        if not self.conn.poll(60):
            raise RuntimeError("the remote engine did not start")
        reply = self.conn.recv()
        if reply[0] != "ready":
            raise RemoteError(*reply[1:])
        self.metadata: bytes = reply[1]

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._ask("call", name, args, kwargs)

    def wait(self, field: str, req_id: Any, timeout: float = GUARD_S) -> Dict[str, List[Any]]:
        found, reports = self._ask("wait", field, req_id, timeout, timeout=timeout + 60)
        assert found, f"the remote never reported {req_id!r} in {field}: {reports}"
        return reports

    def poll_for(self, seconds: float) -> Dict[str, List[Any]]:
        return self._ask("poll_for", seconds, timeout=seconds + 60)

    def start_producer_loop(self, ids: List[Any], batch: int, lease_s: float, timeout: float) -> None:
        """Starts the loop; collect its result with ``answer()``."""
        self.conn.send(("producer_loop", ids, batch, lease_s, timeout))
