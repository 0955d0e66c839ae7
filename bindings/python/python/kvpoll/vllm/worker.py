"""The worker half: registers the KV cache with a kvpoll engine, answers
handshakes, lends finished prefills' blocks and reads remote ones.

Completion is the engine's (each request reported once); this half keeps
only what maps those reports back to vLLM: the remote request id a load
was read under, and loads that failed before reaching the engine."""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

from kvpoll import KvpollError, device_memory, draw_incarnation
from kvpoll.connector import KvConnectorWorker

from .config import KvpollConfig
from .log import get_logger
from .metadata import KvpollConnectorMetadata, LoadSpec, RemotePrefill
from .side_channel import (
    Handshake,
    HandshakeCache,
    HandshakeError,
    HandshakeServer,
    PushRequest,
    new_instance,
    send_push_request,
)

#: Push requests a prefill worker holds before its requests finish.
MAX_PENDING_PUSH_REQUESTS = 4096

logger = get_logger(__name__)


def kv_cache_regions(kv_caches: Mapping[str, Any], num_blocks: int) -> Tuple[Dict[str, list], int]:
    """Cuts each layer's tensor into regions of ``num_blocks`` blocks: the
    dimensions before the block dimension (the first of size
    ``num_blocks``; vLLM's CPU layout has it first, FlashAttention's K/V
    split second) make separate regions, those after it one block. Returns
    the regions by layer and the bytes of one block, the same for all."""
    regions: Dict[str, list] = {}
    block_bytes = None
    for name, t in kv_caches.items():
        device_type = getattr(t.device, "type", "cpu")
        if device_type == "cuda":
            refusal = device_memory()["refusal"]
            if refusal is not None:
                raise ValueError(f"KV layer {name!r} is on {t.device} and cannot be registered: {refusal}")
        elif device_type != "cpu":
            raise ValueError(
                f"KV layer {name!r} is on {t.device}: kvpoll registers host memory and CUDA device memory only"
            )
        if not t.is_contiguous():
            raise ValueError(f"KV layer {name!r} is not contiguous")
        shape = list(t.shape)
        if num_blocks not in shape:
            raise ValueError(f"KV layer {name!r} of shape {shape} has no dimension of {num_blocks} blocks")
        at = shape.index(num_blocks)
        outer = 1
        for d in shape[:at]:
            outer *= d
        per_block = t.numel() // (outer * num_blocks) * t.element_size()
        if block_bytes not in (None, per_block):
            raise ValueError(f"KV layer {name!r} has blocks of {per_block} bytes, others {block_bytes}")
        block_bytes = per_block
        flat = t.reshape(outer, num_blocks, -1)
        regions[name] = [flat[i] for i in range(outer)]
    if block_bytes is None:
        raise ValueError("no KV layers to register")
    return regions, block_bytes


def heads_outermost(kv_caches: Mapping[str, Any], num_blocks: int, kv_heads: int) -> bool:
    """Whether each layer's blocks hold their KV heads outermost (vLLM's CPU
    layout, ``[num_blocks, kv_heads, block_size, 2 * head]``): then the
    heads one tensor-parallel rank holds are one contiguous byte range of
    every block. FlashAttention's ``[2, num_blocks, block_size, kv_heads,
    head]`` interleaves them per token instead."""
    if kv_heads <= 0:
        return False
    for t in kv_caches.values():
        shape = list(t.shape)
        at = shape.index(num_blocks)
        if len(shape) < at + 3 or shape[at + 1] != kv_heads:
            return False
    return True


def tp_reads(
    rank: int, tp: int, remote_tp: int, block_bytes: int, remote_block_bytes: int
) -> List[Tuple[int, Optional[Tuple[int, int]], Optional[Tuple[int, int]]]]:
    """What decode rank ``rank`` of ``tp`` reads from a prefill of
    ``remote_tp`` ranks, each block's heads outermost: ``(remote rank,
    local byte range, remote byte range)`` per remote rank, the ranges
    ``None`` for whole blocks (the same TP size).

    - the same size: rank r reads all of rank r's blocks;
    - a larger prefill (``remote_tp = k * tp``): rank r gathers from ranks
      ``r*k .. r*k+k-1``, the j-th one's whole block into the j-th share
      of its own;
    - a smaller prefill (``tp = k * remote_tp``): rank r reads its share
      (the ``r % k``-th) of every block of rank ``r // k``."""
    if remote_tp == tp:
        return [(rank, None, None)]
    if remote_tp > tp:
        k = remote_tp // tp
        return [
            (rank * k + j, (j * remote_block_bytes, (j + 1) * remote_block_bytes), (0, remote_block_bytes))
            for j in range(k)
        ]
    k = tp // remote_tp
    j = rank % k
    return [(rank // k, (0, block_bytes), (j * block_bytes, (j + 1) * block_bytes))]


def tp_mismatch(tp: int, heads: int, block_bytes: int, hs: Handshake) -> Optional[str]:
    """Why this rank (``heads`` KV heads per block, 0 if not outermost)
    cannot read a prefill rank whose handshake is ``hs``; None if it can."""
    if hs.tp_size == tp:
        if hs.block_bytes != block_bytes:
            return f"blocks of {hs.block_bytes} bytes, this one {block_bytes}: not the same model layout"
        return None
    if max(hs.tp_size, tp) % min(hs.tp_size, tp):
        return f"tp_size {hs.tp_size} and this one's {tp}: one must divide the other"
    if not (heads and hs.block_heads):
        return (
            f"tp_size {hs.tp_size}, this one {tp}: different TP sizes need blocks whose KV heads are "
            "outermost on both sides (vLLM's CPU layout)"
        )
    if hs.block_heads * hs.tp_size != heads * tp:
        return (
            f"{hs.block_heads} KV heads per rank at tp_size {hs.tp_size}, this one {heads} at {tp}: "
            "not the same model, or heads replicated across ranks"
        )
    if hs.block_bytes * heads != block_bytes * hs.block_heads:
        return f"{hs.block_bytes} bytes per block of {hs.block_heads} heads, this one {block_bytes} of {heads}"
    return None


class KvpollWorker:
    def __init__(
        self,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        num_blocks: int,
        config: KvpollConfig,
        kv_heads: int = 0,
    ) -> None:
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_blocks = num_blocks
        self.config = config
        #: KV heads of this rank per block (vLLM's KV cache spec).
        self.kv_heads = kv_heads
        #: ``kv_heads`` if they are outermost in each block, else 0.
        self.block_heads = 0
        self.core: Optional[KvConnectorWorker] = None
        self.num_regions = 0
        self.block_bytes = 0
        self._server: Optional[HandshakeServer] = None
        self._handshakes = HandshakeCache(config.handshake_timeout_s)
        self._peers: Dict[Tuple[str, str], int] = {}  # (engine id, instance) -> peer
        # Engine request id (the prefill's) -> (local id, remote engine, blocks).
        self._loads: Dict[str, Tuple[str, str, List[int]]] = {}
        # Loads that failed before the engine saw them: reported next step.
        self._failed_now: Set[str] = set()
        self._failed_blocks: Set[int] = set()
        # Lends the engine refused: free at once.
        self._unlent: Set[str] = set()
        # The engine was found deaf and that was logged (once).
        self._deaf_logged = False
        self.instance = new_instance()
        # Push mode, prefill side: finished requests' blocks awaiting their
        # decode ranks' push requests (until the lease ends), and push
        # requests (from the side channel's thread) awaiting their request.
        self._pushes: Dict[str, Tuple[List[int], float]] = {}
        self._asks: Dict[str, List[Tuple[PushRequest, float]]] = {}
        self._asks_lock = threading.Lock()
        self._stats = _Stats()

    # ------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        regions, self.block_bytes = kv_cache_regions(kv_caches, self.num_blocks)
        if heads_outermost(kv_caches, self.num_blocks, self.kv_heads):
            self.block_heads = self.kv_heads
        self.num_regions = sum(len(r) for r in regions.values())
        kwargs: Dict[str, Any] = {"idle": self.config.idle, "read_deadline_s": self.config.read_deadline_s}
        if self.config.ucx_tls:
            kwargs["tls"] = self.config.ucx_tls
        core = KvConnectorWorker(block_size=self.block_bytes, lease_s=self.config.lease_s, **kwargs)
        try:
            core.register_kv_caches(regions)
            hs = Handshake(
                engine_id=self.engine_id,
                instance=self.instance,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                block_bytes=self.block_bytes,
                num_regions=self.num_regions,
                num_blocks=self.num_blocks,
                metadata=core.metadata(),
                block_heads=self.block_heads,
            )
            self._server = HandshakeServer(
                self.config.side_channel_host, self.config.side_channel_port + self.tp_rank, hs, self._on_push
            )
        except BaseException:
            core.shutdown()
            raise
        self.core = core
        logger.info(
            "kvpoll: %d regions of %d blocks of %d bytes; handshakes on %s:%d",
            self.num_regions, self.num_blocks, self.block_bytes, *self._server.address,
        )

    # ------------------------------------------------------------ steps

    def start_load_kv(self, meta: KvpollConnectorMetadata) -> None:
        assert self.core is not None, "register_kv_caches first"
        readers = self.config.readers_per_lend(self.tp_size)
        sends = {}
        for req_id, (blocks, inc) in meta.reqs_to_send.items():
            if self.config.mode == "push":
                # Written once its decode ranks asked, or freed at the lease's end.
                self._pushes[req_id] = (list(blocks), time.monotonic() + self.config.lease_s)
            else:
                sends[req_id] = (blocks, readers, inc)
        reads: Dict[str, list] = {}
        for req_id, spec in meta.reqs_to_recv.items():
            handles = self._handles(req_id, spec)
            if handles is not None:
                reads[spec.remote.request_id] = handles
        for req_id, send in sends.items():
            logger.debug("kvpoll: lending %s (blocks %s, %d readers)", req_id, send[0], send[1])
            try:
                self.core.start_load_kv(reqs_to_send={req_id: send})
            except KvpollError as e:
                # Refused (not busy): nothing lent, so nothing holds the
                # blocks. Its release is this step's (vLLM lends only
                # requests it finished), so it is reported this step.
                logger.error("kvpoll: lend of %s refused, its blocks are freed: %s", req_id, e)
                self._unlent.add(req_id)
        for remote_id, handles in reads.items():
            logger.debug("kvpoll: reading %s from %d ranks", remote_id, len(handles))
            try:
                self.core.start_load_kv(reqs_to_recv={remote_id: handles})
            except (KvpollError, KeyError, ValueError) as e:
                local_id, _, blocks = self._loads.pop(remote_id)
                self._fail(local_id, blocks, f"read refused: {e}")
        self._write_asked()

    def _handles(self, req_id: str, spec: LoadSpec) -> Optional[list]:
        """The read handles of one load, or None when it failed already (or
        needs no read: a full local hit releases the lend only)."""
        remote = spec.remote
        if spec.error is not None or remote is None:
            self._fail(req_id, spec.local_block_ids, spec.error or "no remote")
            return None
        try:
            plan = [(rank, self._peer(remote, rank), lb, rb) for rank, lb, rb in self._plan(remote)]
        except (HandshakeError, KvpollError) as e:
            self._fail(req_id, spec.local_block_ids, str(e))
            return None
        if not spec.local_block_ids:
            try:
                self.core.engine.notify_only(remote.request_id, [(peer, remote.incarnation) for _, peer, _, _ in plan])
            except KvpollError as e:
                logger.warning("kvpoll: release of %s at %s not sent: %s", remote.request_id, remote.engine_id, e)
            return None
        loading = self._loads.get(remote.request_id)
        if loading is not None:
            if loading[0] == req_id:
                # The same load again: its one report covers it.
                logger.warning("kvpoll: %s is loading already; the second load is dropped", req_id)
            else:
                self._fail(req_id, spec.local_block_ids, f"{remote.request_id} is being loaded by {loading[0]}")
            return None
        local = list(spec.local_block_ids)
        remote_blocks = list(remote.block_ids[len(remote.block_ids) - len(local):])
        self._loads[remote.request_id] = (req_id, remote.engine_id, local)
        per_block = sum((lb[1] - lb[0]) if lb else self.block_bytes for _, _, lb, _ in plan)
        self._stats.started(remote.request_id, len(local) * per_block * self.num_regions)
        if remote.mode == "push":
            self._ask_push(req_id, remote, local, plan)
            return None
        return [
            (peer, local, remote_blocks, remote.incarnation, *((lb, rb) if lb else ()))
            for _, peer, lb, rb in plan
        ]

    # ------------------------------------------------------------ push

    def _ask_push(self, req_id: str, remote: RemotePrefill, local: List[int], plan: list) -> None:
        """Push mode, decode side: lends ``local`` to the prefill ranks of
        ``plan`` as writers, then asks each to write its share. The engine
        reports the lend once (every writer done, or failed): as a load."""
        inc = draw_incarnation()
        try:
            self.core.start_load_kv(reqs_to_recv_push={remote.request_id: (local, len(plan), inc)})
        except KvpollError as e:
            self._loads.pop(remote.request_id, None)
            self._fail(req_id, local, f"push destination refused: {e}")
            return
        for rank, _, lb, rb in plan:
            ask = PushRequest(
                engine_id=remote.engine_id,
                request_id=remote.request_id,
                decode_engine_id=self.engine_id,
                decode_instance=self.instance,
                decode_rank=self.tp_rank,
                metadata=self.core.metadata(),
                block_ids=tuple(local),
                incarnation=inc,
                # The prefill writes what this rank would have read.
                local_bytes=rb,
                remote_bytes=lb,
            )
            try:
                send_push_request(remote.host, remote.port + rank, rank, ask, self.config.handshake_timeout_s)
            except HandshakeError as e:
                logger.warning("kvpoll: push of %s from rank %d not asked, the load fails: %s", req_id, rank, e)
                try:
                    # Ended now: reported failed once no writer can still write.
                    self.core.engine.abort(remote.request_id)
                except KvpollError:
                    pass
                return

    def _on_push(self, ask: PushRequest) -> Optional[str]:
        """A decode rank's push request (on the side channel's thread)."""
        if ask.engine_id != self.engine_id:
            return f"this is engine {self.engine_id!r}, not {ask.engine_id!r}"
        if self.config.mode != "push":
            return "this prefill lends its blocks to readers (mode pull)"
        with self._asks_lock:
            if sum(len(v) for v in self._asks.values()) >= MAX_PENDING_PUSH_REQUESTS:
                return f"{MAX_PENDING_PUSH_REQUESTS} push requests pending"
            self._asks.setdefault(ask.request_id, []).append((ask, time.monotonic()))
        return None

    def _write_asked(self) -> None:
        """Push mode, prefill side: writes each finished request every one
        of its decode ranks asked for; frees those nobody asked for in the
        lease (their decode fails its load when its own lease ends), and
        forgets requests for requests it does not hold."""
        if self.config.mode != "push" or self.core is None:
            return
        now = time.monotonic()
        readers = self.config.readers_per_lend(self.tp_size)
        ready: List[Tuple[str, List[PushRequest]]] = []
        with self._asks_lock:
            for req_id in list(self._asks):
                asks = self._asks[req_id]
                if req_id in self._pushes and len(asks) >= readers:
                    ready.append((req_id, [a for a, _ in asks[:readers]]))
                    del self._asks[req_id]
                elif req_id not in self._pushes:
                    kept = [(a, t) for a, t in asks if now - t < self.config.lease_s]
                    if kept:
                        self._asks[req_id] = kept
                    else:
                        del self._asks[req_id]
        for req_id, asks in ready:
            blocks, _ = self._pushes.pop(req_id)
            try:
                handles = [self._push_handle(blocks, a) for a in asks]
                self.core.save_kv(req_id, handles, expected_acks=len(asks))
                self.core.wait_for_save()
            except (KvpollError, ValueError) as e:
                logger.error("kvpoll: push of %s not written, its blocks are freed: %s", req_id, e)
                self._unlent.add(req_id)
        for req_id, (_, deadline) in list(self._pushes.items()):
            if now >= deadline:
                logger.warning("kvpoll: no decode asked for %s within the lease, its blocks are freed", req_id)
                del self._pushes[req_id]
                self._unlent.add(req_id)

    def _push_handle(self, blocks: List[int], ask: PushRequest) -> tuple:
        if len(ask.block_ids) > len(blocks):
            raise ValueError(f"{len(ask.block_ids)} blocks asked for, {len(blocks)} held")
        key = (ask.decode_engine_id, ask.decode_instance)
        peer = self._peers.get(key)
        if peer is None:
            peer = self.core.engine.add_peer(ask.metadata, any_block_size=ask.local_bytes is not None)
            self._peers[key] = peer
        local = blocks[len(blocks) - len(ask.block_ids) :]
        part = (ask.local_bytes, ask.remote_bytes) if ask.local_bytes else ()
        return (peer, local, list(ask.block_ids), ask.incarnation, *part)

    def _plan(self, remote: RemotePrefill) -> list:
        """The remote ranks this rank reads a load from, and the byte
        ranges of each block (see ``tp_reads``)."""
        if max(remote.tp_size, self.tp_size) % min(remote.tp_size, self.tp_size):
            raise HandshakeError(f"prefill tp_size {remote.tp_size}, decode {self.tp_size}: one must divide the other")
        first = min(self.tp_rank * remote.tp_size // self.tp_size, remote.tp_size - 1)
        hs = self._handshakes.get(remote.engine_id, remote.host, remote.port, first)
        return tp_reads(self.tp_rank, self.tp_size, remote.tp_size, self.block_bytes, hs.block_bytes)

    def _peer(self, remote: RemotePrefill, rank: int) -> int:
        engine_id = remote.engine_id
        hs = self._handshakes.get(engine_id, remote.host, remote.port, rank)
        if hs.num_regions != self.num_regions:
            why = f"{hs.num_regions} regions, this one {self.num_regions}: not the same model layout"
        elif hs.tp_size != remote.tp_size:
            why = f"tp_size {hs.tp_size}, the request says {remote.tp_size}"
        else:
            why = tp_mismatch(self.tp_size, self.block_heads, self.block_bytes, hs)
        if why is not None:
            self._handshakes.forget(engine_id)
            raise HandshakeError(f"engine {engine_id!r} rank {rank}: {why}")
        key = (engine_id, hs.instance)
        peer = self._peers.get(key)
        if peer is None:
            peer = self.core.engine.add_peer(hs.metadata, any_block_size=hs.block_bytes != self.block_bytes)
            self._peers[key] = peer
        return peer

    def _fail(self, req_id: str, blocks: List[int], why: str) -> None:
        logger.warning("kvpoll: load of %s failed: %s", req_id, why)
        self._failed_now.add(req_id)
        self._failed_blocks.update(blocks)
        self._stats.failed(req_id)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        assert self.core is not None
        self._write_asked()
        if not self._deaf_logged and self.core.engine.is_deaf:
            self._deaf_logged = True
            logger.error(
                "kvpoll: this worker's engine hears no more messages (a peer was killed inside a "
                "shared-memory send to it): its transfers fail from now on; restart this worker"
            )
        sending, recving = self.core.get_finished(finished_req_ids)
        if sending:
            logger.debug("kvpoll: blocks of %s free", sorted(sending))
        if self._unlent:
            sending = (sending or set()) | self._unlent
            self._unlent = set()
        done: Set[str] = set(self._failed_now)
        self._failed_now.clear()
        for remote_id in recving or ():
            local_id, engine_id, _ = self._loads.pop(remote_id, (remote_id, "", []))
            done.add(local_id)
            reason = self.core.failure_reasons.get(remote_id)
            if reason is not None:
                logger.warning(
                    "kvpoll: load of %s (%s at engine %s) failed: %s (transport status %d)",
                    local_id, remote_id, engine_id, *reason,
                )
                self._stats.failed(remote_id)
                # The remote may be a new instance now: ask again next time.
                self._handshakes.forget(engine_id)
            else:
                logger.debug("kvpoll: load of %s (%s) finished", local_id, remote_id)
                self._stats.finished(remote_id)
        return sending, (done or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        out = self._failed_blocks
        self._failed_blocks = set()
        if self.core is not None:
            out |= self.core.get_block_ids_with_load_errors()
        return out

    def get_kv_connector_stats(self) -> Optional[Dict[str, Any]]:
        return self._stats.take()

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.core is not None:
            self.core.shutdown()
            self.core = None


class _Stats:
    """Transfers, failures, bytes and durations since the last take()."""

    def __init__(self) -> None:
        self._started: Dict[str, Tuple[float, int]] = {}
        self._reset()

    def _reset(self) -> None:
        self.data: Dict[str, Any] = {"num_transfers": 0, "num_failed": 0, "bytes": 0, "durations_s": []}

    def started(self, req_id: str, nbytes: int) -> None:
        self._started[req_id] = (time.monotonic(), nbytes)

    def finished(self, req_id: str) -> None:
        t0, nbytes = self._started.pop(req_id, (None, 0))
        if t0 is not None:
            self.data["num_transfers"] += 1
            self.data["bytes"] += nbytes
            self.data["durations_s"].append(time.monotonic() - t0)

    def failed(self, req_id: str) -> None:
        self._started.pop(req_id, None)
        self.data["num_failed"] += 1

    def take(self) -> Optional[Dict[str, Any]]:
        if not (self.data["num_transfers"] or self.data["num_failed"]):
            return None
        out = self.data
        self._reset()
        return out
