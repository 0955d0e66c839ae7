"""The worker side of a KV connector, on top of ``kvpoll.Engine``.

``KvConnectorWorker`` has the method names and shapes of vLLM's KV-connector
worker API (``KVConnectorBase_V1``): ``register_kv_caches``,
``start_load_kv``, ``wait_for_save``, ``get_finished`` and
``get_block_ids_with_load_errors``. It takes plain arguments and imports
nothing from vLLM; ``kvpoll.vllm.KvpollConnector`` is the
``KVConnectorBase_V1`` subclass that unpacks its connector metadata into
these calls.

What it keeps is only what vLLM's scheduler contract needs on top of the
engine's reports: which finished sends the scheduler has already released
(``get_finished``'s ``finished_req_ids``), the block ids of failed loads
until they are collected, and submissions refused with ``BusyError``
(retried next step). Completion tracking itself is the engine's: no
per-handle state is kept or re-checked here.

Modes:

- pull (decode reads): the producer lends its blocks with
  ``start_load_kv(reqs_to_send=...)``; the consumer reads them with
  ``start_load_kv(reqs_to_recv=...)``; the read notifies the producer,
  which releases the lend.
- push (prefill writes): the consumer lends destination blocks with
  ``start_load_kv(reqs_to_recv_push=...)``; the producer queues writes with
  ``save_kv`` and submits them in ``wait_for_save``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import (
    Any,
    Dict,
    Hashable,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

from ._kvpoll import BusyError, Engine, KvpollError, device_memory

RequestId = Union[str, int]
#: One handle of a load: (remote, local block ids, remote block ids, lend
#: incarnation). The remote is a name given to ``add_remote`` or a peer id
#: from ``Engine.add_peer``; the incarnation is what the remote's lend
#: returned (``incarnation(req_id)`` there), carried with the block ids.
LoadHandle = Tuple[Hashable, Sequence[int], Sequence[int], int]
#: What to lend for a request: its block ids, (block ids, readers), or
#: (block ids, readers, incarnation) with one drawn by
#: ``kvpoll.draw_incarnation()`` and already handed out with the ids.
SendSpec = Union[Sequence[int], Tuple[Sequence[int], int], Tuple[Sequence[int], int, int]]

__all__ = ["KvConnectorWorker", "LoadHandle", "SendSpec", "region_of"]

logger = logging.getLogger(__name__)


def region_of(layer: Any) -> Union[Any, Tuple[int, int]]:
    """What ``Engine.register_buffer`` takes for one KV layer: a torch tensor
    in host memory becomes ``(data_ptr, nbytes)`` (it must be contiguous);
    a CUDA tensor or array is passed as it is, where CUDA memory can be
    registered (``kvpoll.device_memory()``); anything else (a numpy array,
    a ``(ptr, nbytes)`` tuple) is passed as it is. Raises ``ValueError``
    for memory that cannot be registered: device memory where this build,
    driver or UCX cannot register it (saying which is missing), a tensor
    on another kind of device, or a ``(ptr, nbytes)`` range this process
    has not mapped readable and writable. Registering such memory would
    make UCX's host transports fault on the first transfer, far from the
    cause."""
    device = getattr(layer, "device", None)
    device_type = getattr(device, "type", "cpu") if device is not None else "cpu"
    cuda_array = hasattr(layer, "__cuda_array_interface__") and not hasattr(layer, "__array_interface__")
    if device_type == "cuda" or cuda_array:
        refusal = device_memory()["refusal"]
        if refusal is not None:
            what = f"a tensor on {device}" if device_type == "cuda" else "a CUDA array"
            raise ValueError(f"{what} cannot be registered: {refusal}")
        return layer
    if device_type != "cpu":
        raise ValueError(
            f"a tensor on {device}: kvpoll registers host and CUDA memory only "
            "(put the KV cache in host memory, e.g. vLLM's CPU backend)"
        )
    if hasattr(layer, "data_ptr") and hasattr(layer, "element_size"):
        if hasattr(layer, "is_contiguous") and not layer.is_contiguous():
            raise ValueError("a KV layer tensor must be contiguous")
        layer = (layer.data_ptr(), layer.numel() * layer.element_size())
    if _is_raw_pair(layer):
        _check_host_range(*layer)
    return layer


def _check_host_range(ptr: int, nbytes: int) -> None:
    """Refuses ``[ptr, ptr + nbytes)`` unless read-write mappings of this
    process cover it (``/proc/self/maps``; not checked where that file is
    missing). A device pointer is either unmapped on the host or inside a
    reservation without access rights."""
    if ptr == 0:
        raise ValueError("address 0 is not host memory")
    try:
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
    except OSError:
        return
    at, end = ptr, ptr + nbytes
    for line in maps:
        fields = line.split(None, 2)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= at < hi:
            if not fields[1].startswith("rw"):
                break
            at = hi
            if at >= end:
                return
    raise ValueError(
        f"[{ptr:#x}, {end:#x}) is not host memory this process can read and write "
        f"(no read-write mapping at {at:#x}): kvpoll registers host memory only"
    )


class KvConnectorWorker:
    """Worker-side connector core: vLLM's KV-connector worker methods over a
    kvpoll engine.

    ``KvConnectorWorker(block_size=..., engine=None, lease_s=120.0,
    **engine_kwargs)``: ``block_size`` is the bytes of one block in one
    registered region; ``engine_kwargs`` go to ``kvpoll.Engine`` (``tls``,
    ``core``, ``idle``, ``read_deadline_s``, ``lend_grace_s``, ``slots``,
    ``max_blocks``).
    Pass ``engine`` to use an engine you made. ``lease_s`` bounds how long
    lent blocks wait for their readers or writers.

    Each request id is returned once by ``get_finished``: in ``recving``
    when its load finished or failed (failed loads' blocks are returned by
    ``get_block_ids_with_load_errors``), in ``sending`` when its lent or
    written blocks are free again.
    """

    def __init__(
        self,
        *,
        block_size: Optional[int] = None,
        engine: Optional[Engine] = None,
        lease_s: float = 120.0,
        **engine_kwargs: Any,
    ) -> None:
        if engine is None:
            if block_size is None:
                raise TypeError("KvConnectorWorker needs block_size= or engine=")
            engine = Engine(block_size=block_size, **engine_kwargs)
        elif block_size is not None and block_size != engine.block_size:
            raise ValueError(
                f"block_size={block_size} but the engine's is {engine.block_size}"
            )
        self.engine: Engine = engine
        self.lease_s = float(lease_s)
        self._remotes: Dict[Hashable, int] = {}
        # Reported by the engine as free, not yet released by the scheduler.
        self._sent: Set[RequestId] = set()
        # Ids the scheduler finished (get_finished's argument) whose sends
        # are still in flight here.
        self._released: Set[RequestId] = set()
        # Releases of ids with no send yet (vLLM may finish a request before
        # the step that lends it), by when: kept for ``lease_s``, as long as
        # a send of that id could still be useful.
        self._early: Dict[RequestId, float] = {}
        # Sends (lends to readers, writes) not yet reported, submitted or
        # waiting in the backlog.
        self._sending: Set[RequestId] = set()
        self._recved: Set[RequestId] = set()
        # Blocks lent to remote writers, by request: invalid if it expires.
        self._push_dest: Dict[RequestId, List[int]] = {}
        #: The incarnation of each lend this worker made, for its readers.
        self._incarnations: Dict[RequestId, int] = {}
        self._load_errors: Set[int] = set()
        #: The loads among the last ``get_finished``'s ``recving`` that failed.
        self.failed: Set[RequestId] = set()
        #: Why each of ``failed`` failed: the engine's cause (``deadline``,
        #: ``peer_stalled``, ``lease_lost``, ...) and the transport status.
        self.failure_reasons: Dict[RequestId, Tuple[str, int]] = {}
        # Loads failed outside the engine's reports, for the next ``failed``.
        self._failed_next: Dict[RequestId, Tuple[str, int]] = {}
        self._saves: List[Tuple[RequestId, _Write]] = []
        # Submissions refused with BusyError, retried each step in order.
        self._backlog: List[Tuple[RequestId, _Op]] = []
        # The objects whose memory is registered, kept alive with the engine.
        self._kept: List[Any] = []

    # ------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> List[int]:
        """Registers every KV layer: ``kv_caches`` maps a layer name to a
        buffer (numpy array), a ``(ptr, nbytes)`` pair, a torch tensor, or a
        list or tuple of those (say a layer's K and V halves, when they are
        not contiguous together). Every region must hold the same number of
        blocks of ``block_size`` bytes. Returns the region indices, in
        order. Every layer is checked before any is registered: a refused
        one (``ValueError`` naming it) leaves the engine as it was."""
        checked = []
        for name, layer in kv_caches.items():
            parts = layer if isinstance(layer, list) else [layer]
            if isinstance(layer, tuple) and not _is_raw_pair(layer):
                parts = list(layer)
            for part in parts:
                try:
                    checked.append((name, part, region_of(part)))
                except (TypeError, ValueError) as e:
                    raise type(e)(f"KV layer {name!r}: {e}") from e
        regions = []
        for name, part, region in checked:
            try:
                regions.append(self.engine.register_buffer(region))
            except (TypeError, ValueError) as e:
                raise type(e)(f"KV layer {name!r}: {e}") from e
            # UCX exposes the memory to peers for the engine's life: the
            # object that owns it must live as long (a torch tensor is
            # registered by its address, which alone keeps nothing alive).
            self._kept.append(part)
        return regions

    def metadata(self) -> bytes:
        """This worker's metadata, for its remotes' ``add_remote``."""
        return self.engine.local_metadata()

    def add_remote(self, name: Hashable, metadata: bytes) -> int:
        """Connects to a remote worker (by its ``metadata()``) under
        ``name``, which load handles may then use. Returns its peer id."""
        peer = self.engine.add_peer(metadata)
        self._remotes[name] = peer
        return peer

    def remove_remote(self, name: Hashable) -> None:
        """Disconnects a remote: its handles in flight fail."""
        self.engine.remove_peer(self._remotes.pop(name))

    def _peer(self, remote: Hashable) -> int:
        peer = self._remotes.get(remote)
        if peer is not None:
            return peer
        if isinstance(remote, int) and not isinstance(remote, bool):
            return remote
        raise KeyError(f"unknown remote {remote!r}: add_remote it first")

    def _handles(self, handles: Iterable[LoadHandle]) -> List[Tuple[int, Sequence[int], Sequence[int], int]]:
        return [(self._peer(h[0]), h[1], h[2], *h[3:]) for h in handles]

    def incarnation(self, req_id: RequestId) -> int:
        """The incarnation of this worker's lend of ``req_id``: hand it to
        the readers (or writers) with the block ids."""
        return self._incarnations[req_id]

    # ------------------------------------------------------ vLLM worker API

    def start_load_kv(
        self,
        reqs_to_recv: Optional[Mapping[RequestId, Sequence[LoadHandle]]] = None,
        reqs_to_send: Optional[Mapping[RequestId, SendSpec]] = None,
        reqs_to_recv_push: Optional[Mapping[RequestId, Tuple[Sequence[int], int]]] = None,
    ) -> None:
        """Starts this step's transfers, all asynchronous:

        - ``reqs_to_recv``: request -> load handles (pull: read the
          producers' blocks into ours);
        - ``reqs_to_send``: request -> block ids, or (block ids, readers):
          lend our blocks to that many remote readers (default 1);
        - ``reqs_to_recv_push``: request -> (block ids, writers): lend our
          blocks to remote writers (receive).

        A submission the engine refuses as busy is retried next step (in
        order); any other refusal raises at once: that request and the
        ones after it in this call are not submitted. One refused for
        good when retried is reported instead (logged): a read as a failed
        load, a lend or write as sent (nothing holds its blocks)."""
        self._retry_backlog()
        for req_id, spec in (reqs_to_send or {}).items():
            self._submit(req_id, _Lend.of(spec))
        for req_id, (blocks, writers, *inc) in (reqs_to_recv_push or {}).items():
            self._submit(req_id, _Receive(list(blocks), writers, inc[0] if inc else None))
        for req_id, handles in (reqs_to_recv or {}).items():
            self._submit(req_id, _Read(self._handles(handles)))

    def save_kv(
        self,
        req_id: RequestId,
        handles: Sequence[LoadHandle],
        expected_acks: int = 1,
    ) -> None:
        """Queues a push of ``handles`` (local blocks into blocks the
        remotes lent to writers); submitted by ``wait_for_save``."""
        self._saves.append((req_id, _Write(self._handles(handles), expected_acks)))

    def wait_for_save(self) -> None:
        """Submits the pushes queued by ``save_kv``. It does not block on
        the network: each push is reported by ``get_finished`` (in
        ``sending``) once written, flushed and acknowledged."""
        saves, self._saves = self._saves, []
        for req_id, write in saves:
            self._submit(req_id, write)

    def get_finished(
        self, finished_req_ids: Iterable[RequestId] = ()
    ) -> Tuple[Optional[Set[RequestId]], Optional[Set[RequestId]]]:
        """Polls the engine. Returns ``(sending, recving)``, each ``None``
        when empty:

        - ``recving``: loads that finished, or failed (their blocks are in
          ``get_block_ids_with_load_errors()``);
        - ``sending``: requests whose lent or written blocks are free,
          among those the scheduler has finished (``finished_req_ids`` of
          this call or an earlier one), as vLLM requires.

        Every request id appears once over the worker's life."""
        self._retry_backlog()
        self.failure_reasons, self._failed_next = self._failed_next, {}
        r = self.engine.poll()
        if r:
            recving = r.finished_recving
            failed = r.failed_recving
            if failed:
                recving |= failed.keys()
                reasons = r.failure_reasons
                for req_id in failed:
                    self.failure_reasons[req_id] = reasons.get(req_id, ("unknown", 0))
                for blocks in failed.values():
                    self._load_errors.update(blocks)
            freed = r.finished_sending
            # A failed write is never done, but its source blocks are free.
            freed |= r.failed_sending.keys()
            for req_id in r.expired:
                blocks = self._push_dest.pop(req_id, None)
                if blocks is None:
                    logger.warning("kvpoll: the lease of %r ended before its readers or writers were done", req_id)
                    freed.add(req_id)
                else:  # a push that never completed: a failed load
                    recving.add(req_id)
                    self.failure_reasons[req_id] = ("lease_expired", 0)
                    self._load_errors.update(blocks)
            if self._push_dest:
                for req_id in recving:
                    self._push_dest.pop(req_id, None)
            self._recved |= recving
            if self._incarnations:
                for req_id in freed | recving:
                    self._incarnations.pop(req_id, None)
            if freed:
                self._sending -= freed
                self._sent |= freed
        now = time.monotonic()
        for req_id in finished_req_ids:
            if req_id in self._sending or req_id in self._sent:
                self._released.add(req_id)
            else:
                self._early[req_id] = now
        if self._early:
            stale = now - self.lease_s
            for req_id in [i for i, t in self._early.items() if t < stale]:
                del self._early[req_id]
        sending = self._sent & self._released
        if sending:
            self._sent -= sending
            self._released -= sending
        self.failed = set(self.failure_reasons)
        recving_out = self._recved
        self._recved = set()
        return (sending or None, recving_out or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Block ids whose loads failed since the last call (to recompute)."""
        out, self._load_errors = self._load_errors, set()
        return out

    # ------------------------------------------------------------ more

    def heartbeat(self, req_ids: Iterable[RequestId], extend_s: Optional[float] = None) -> None:
        """Extends the leases of these lends or pushes (default: by lease_s)."""
        self.engine.heartbeat(list(req_ids), self.lease_s if extend_s is None else extend_s)

    def abort(self, req_id: RequestId) -> None:
        """Aborts a request in flight; it is still reported once."""
        self.engine.abort(req_id)

    @property
    def pending(self) -> int:
        """Submissions waiting for room in the engine (busy)."""
        return len(self._backlog)

    def shutdown(self) -> None:
        """Shuts the engine down."""
        self.engine.shutdown()

    def __enter__(self) -> "KvConnectorWorker":
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.shutdown()
        return False

    # ------------------------------------------------------------ internals

    def _submit(self, req_id: RequestId, op: "_Op") -> None:
        if op.sends:
            # A send from now on, in the engine or in the backlog: a release
            # that arrives while it waits must not be lost.
            self._sending.add(req_id)
            if self._early.pop(req_id, None) is not None:
                self._released.add(req_id)
        if self._backlog:
            # Keep submission order: behind what is already waiting.
            self._backlog.append((req_id, op))
            return
        try:
            op.submit(self, req_id)
        except BusyError:
            self._backlog.append((req_id, op))
        except Exception:
            # Refused at once: raised to the caller, and never reported.
            self._sending.discard(req_id)
            self._released.discard(req_id)
            raise

    def _retry_backlog(self) -> None:
        while self._backlog:
            req_id, op = self._backlog[0]
            try:
                op.submit(self, req_id)
            except BusyError:
                return  # still full: next step
            except (KvpollError, TypeError, ValueError) as e:
                # Refused for good, steps after it was submitted: nobody
                # is there to catch it, so it is reported like any end.
                logger.error("kvpoll: %s of %r refused after waiting for room: %s", op.name, req_id, e)
                op.refused(self, req_id)
            self._backlog.pop(0)

    def _load_failed(self, req_id: RequestId, blocks: Iterable[int]) -> None:
        """A load (read or receive) that ended before the engine took it:
        reported failed next ``get_finished``, its blocks invalid."""
        self._recved.add(req_id)
        self._failed_next[req_id] = ("refused", 0)
        self._load_errors.update(blocks)

    def _send_freed(self, req_id: RequestId) -> None:
        """A send (lend or write) that ended before the engine took it:
        nothing holds its blocks."""
        self._sending.discard(req_id)
        self._sent.add(req_id)


class _Op:
    """One submission to the engine, kept as it is while it waits for room
    (``BusyError``). ``submit`` hands it to the engine; ``refused`` reports
    it when the engine refuses it for good after it waited."""

    name = ""
    #: A send (its blocks are freed through ``get_finished``'s sending).
    sends = False

    def submit(self, w: KvConnectorWorker, req_id: RequestId) -> None:
        raise NotImplementedError

    def refused(self, w: KvConnectorWorker, req_id: RequestId) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class _Lend(_Op):
    """Lend blocks to ``readers`` remote readers (pull, the producer)."""

    blocks: List[int]
    readers: int = 1
    incarnation: Optional[int] = None
    name = "lend"
    sends = True

    @classmethod
    def of(cls, spec: SendSpec) -> "_Lend":
        """From a ``SendSpec``: block ids, (ids, readers) or (ids,
        readers, incarnation)."""
        if isinstance(spec, tuple) and len(spec) in (2, 3) and not isinstance(spec[0], int):
            return cls(list(spec[0]), *spec[1:])
        return cls(list(spec))

    def submit(self, w: KvConnectorWorker, req_id: RequestId) -> None:
        w._incarnations[req_id] = w.engine.lend(
            req_id, self.blocks, readers=self.readers, lease_s=w.lease_s, incarnation=self.incarnation
        )

    def refused(self, w: KvConnectorWorker, req_id: RequestId) -> None:
        w._send_freed(req_id)


@dataclass(frozen=True)
class _Receive(_Op):
    """Lend blocks to ``writers`` remote writers (push, the consumer)."""

    blocks: List[int]
    writers: int
    incarnation: Optional[int] = None
    name = "receive"

    def submit(self, w: KvConnectorWorker, req_id: RequestId) -> None:
        w._incarnations[req_id] = w.engine.receive(
            req_id, self.blocks, writers=self.writers, lease_s=w.lease_s, incarnation=self.incarnation
        )
        w._push_dest[req_id] = self.blocks

    def refused(self, w: KvConnectorWorker, req_id: RequestId) -> None:
        w._load_failed(req_id, self.blocks)


@dataclass(frozen=True)
class _Read(_Op):
    """Read remote blocks into ours (pull, the consumer)."""

    handles: List[Tuple[Any, ...]]
    name = "read"

    def submit(self, w: KvConnectorWorker, req_id: RequestId) -> None:
        w.engine.read(req_id, self.handles)

    def refused(self, w: KvConnectorWorker, req_id: RequestId) -> None:
        w._load_failed(req_id, (b for h in self.handles for b in h[1]))


@dataclass(frozen=True)
class _Write(_Op):
    """Write our blocks into remote receives (push, the producer)."""

    handles: List[Tuple[Any, ...]]
    acks: int
    name = "write"
    sends = True

    def submit(self, w: KvConnectorWorker, req_id: RequestId) -> None:
        w.engine.write(req_id, self.handles, expected_acks=self.acks, lease_s=w.lease_s)

    def refused(self, w: KvConnectorWorker, req_id: RequestId) -> None:
        w._send_freed(req_id)


def _is_raw_pair(t: Any) -> bool:
    return isinstance(t, tuple) and len(t) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in t)
