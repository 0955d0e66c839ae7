"""The worker half: registers the KV cache with a kvpoll engine, answers
handshakes, lends finished prefills' blocks and reads remote ones.

Completion is the engine's (each request reported once); this half keeps
only what maps those reports back to vLLM: the remote request id a load
was read under, and loads that failed before reaching the engine."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

from kvpoll import KvpollError
from kvpoll.connector import KvConnectorWorker

from .config import KvpollConfig
from .metadata import KvpollConnectorMetadata, LoadSpec
from .side_channel import Handshake, HandshakeCache, HandshakeError, HandshakeServer, new_instance

logger = logging.getLogger(__name__)


def kv_cache_regions(kv_caches: Mapping[str, Any], num_blocks: int) -> Tuple[Dict[str, list], int]:
    """Cuts each layer's tensor into regions of ``num_blocks`` blocks: the
    dimensions before the block dimension (the first of size
    ``num_blocks``; vLLM's CPU layout has it first, FlashAttention's K/V
    split second) make separate regions, those after it one block. Returns
    the regions by layer and the bytes of one block, the same for all."""
    regions: Dict[str, list] = {}
    block_bytes = None
    for name, t in kv_caches.items():
        if getattr(t.device, "type", "cpu") != "cpu":
            raise ValueError(f"KV layer {name!r} is on {t.device}: kvpoll registers host memory only")
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


class KvpollWorker:
    def __init__(self, engine_id: str, tp_rank: int, tp_size: int, num_blocks: int, config: KvpollConfig) -> None:
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_blocks = num_blocks
        self.config = config
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
        self._stats = _Stats()

    # ------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        regions, self.block_bytes = kv_cache_regions(kv_caches, self.num_blocks)
        self.num_regions = sum(len(r) for r in regions.values())
        kwargs: Dict[str, Any] = {"idle": self.config.idle, "read_deadline_s": self.config.read_deadline_s}
        if self.config.ucx_tls:
            kwargs["tls"] = self.config.ucx_tls
        core = KvConnectorWorker(block_size=self.block_bytes, lease_s=self.config.lease_s, **kwargs)
        try:
            core.register_kv_caches(regions)
            hs = Handshake(
                engine_id=self.engine_id,
                instance=new_instance(),
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                block_bytes=self.block_bytes,
                num_regions=self.num_regions,
                num_blocks=self.num_blocks,
                metadata=core.metadata(),
            )
            self._server = HandshakeServer(
                self.config.side_channel_host, self.config.side_channel_port + self.tp_rank, hs
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
        sends = {req_id: (blocks, 1, inc) for req_id, (blocks, inc) in meta.reqs_to_send.items()}
        reads: Dict[str, list] = {}
        for req_id, spec in meta.reqs_to_recv.items():
            handles = self._handles(req_id, spec)
            if handles is not None:
                reads[spec.remote.request_id] = handles
        for req_id, send in sends.items():
            try:
                self.core.start_load_kv(reqs_to_send={req_id: send})
            except KvpollError as e:
                # Refused (not busy): nothing lent, so nothing holds the
                # blocks. Its release is this step's (vLLM lends only
                # requests it finished), so it is reported this step.
                logger.error("kvpoll: lend of %s refused, its blocks are freed: %s", req_id, e)
                self._unlent.add(req_id)
        for remote_id, handles in reads.items():
            try:
                self.core.start_load_kv(reqs_to_recv={remote_id: handles})
            except (KvpollError, KeyError, ValueError) as e:
                local_id, _, blocks = self._loads.pop(remote_id)
                self._fail(local_id, blocks, f"read refused: {e}")

    def _handles(self, req_id: str, spec: LoadSpec) -> Optional[list]:
        """The read handles of one load, or None when it failed already (or
        needs no read: a full local hit releases the lend only)."""
        remote = spec.remote
        if spec.error is not None or remote is None:
            self._fail(req_id, spec.local_block_ids, spec.error or "no remote")
            return None
        try:
            peer = self._peer(remote.engine_id, remote.host, remote.port)
        except (HandshakeError, KvpollError) as e:
            self._fail(req_id, spec.local_block_ids, str(e))
            return None
        if not spec.local_block_ids:
            try:
                self.core.engine.notify_only(remote.request_id, [(peer, remote.incarnation)])
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
        self._stats.started(remote.request_id, len(local) * self.block_bytes * self.num_regions)
        return [(peer, local, remote_blocks, remote.incarnation)]

    def _peer(self, engine_id: str, host: str, port: int) -> int:
        hs = self._handshakes.get(engine_id, host, port, self.tp_rank)
        if (hs.block_bytes, hs.num_regions) != (self.block_bytes, self.num_regions):
            self._handshakes.forget(engine_id)
            raise HandshakeError(
                f"engine {engine_id!r} has {hs.num_regions} regions of {hs.block_bytes}-byte blocks, "
                f"this one {self.num_regions} of {self.block_bytes}: not the same model layout"
            )
        key = (engine_id, hs.instance)
        peer = self._peers.get(key)
        if peer is None:
            peer = self.core.engine.add_peer(hs.metadata)
            self._peers[key] = peer
        return peer

    def _fail(self, req_id: str, blocks: List[int], why: str) -> None:
        logger.warning("kvpoll: load of %s failed: %s", req_id, why)
        self._failed_now.add(req_id)
        self._failed_blocks.update(blocks)
        self._stats.failed(req_id)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        assert self.core is not None
        sending, recving = self.core.get_finished(finished_req_ids)
        if self._unlent:
            sending = (sending or set()) | self._unlent
            self._unlent = set()
        done: Set[str] = set(self._failed_now)
        self._failed_now.clear()
        for remote_id in recving or ():
            local_id, engine_id, _ = self._loads.pop(remote_id, (remote_id, "", []))
            done.add(local_id)
            if remote_id in self.core.failed:
                self._stats.failed(remote_id)
                # The remote may be a new instance now: ask again next time.
                self._handshakes.forget(engine_id, self.tp_rank)
            else:
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
