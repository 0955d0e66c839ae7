"""The worker half: registers the KV cache with a kvpoll engine, answers
handshakes, lends finished prefills' blocks and reads remote ones.

Completion is the engine's (each request reported once). What this half
adds is the decode side's state of each entry the scheduler hands it
(``LoadState``): a load vLLM waits for goes from handshaking (the
prefill's handshakes are fetched in the background, across steps) to
loading (the engine has it) to reported, or fails before the engine and
is reported; a release (a request vLLM already freed) is sent and never
reported. What goes into ``finished_recving`` is derived from those
states, so a report for a request vLLM no longer tracks cannot happen.
Nothing on vLLM's step waits on the network: handshakes, push requests
and push releases run on the side channel's threads."""

from __future__ import annotations

import enum
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

from kvpoll import KvpollError, device_memory, draw_incarnation
from kvpoll.connector import KvConnectorWorker

from .auth import SideChannelKey, load_secret
from .config import MAX_GATHER, KvpollConfig
from .layout import attention_isa, block_plan, element_offsets, group_order, regroup
from .log import get_logger
from .metadata import KvpollConnectorMetadata, LoadSpec, RemotePrefill
from .side_channel import (
    Handshake,
    HandshakeCache,
    HandshakeError,
    HandshakeServer,
    PushRelease,
    PushRequest,
    new_instance,
    send_push_release,
    send_push_request,
)

#: Push requests a prefill worker holds before its requests finish.
MAX_PENDING_PUSH_REQUESTS = 4096
#: A load waits for its prefill's handshakes at most this many handshake
#: timeouts (each fetch is bounded by one; this bounds the queue for the
#: fetching threads too).
HANDSHAKE_BOUND = 3

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


def distinct_tensors(kv_caches: Mapping[str, Any]) -> Dict[str, Any]:
    """The layers whose tensors begin at distinct addresses: of layers
    that share one (each of vLLM's hybrid KV cache groups lays its layers
    over the same tensors), the first named."""
    out: Dict[str, Any] = {}
    seen: Set[int] = set()
    for name, t in kv_caches.items():
        ptr = t.data_ptr() if hasattr(t, "data_ptr") else id(t)
        if ptr not in seen:
            seen.add(ptr)
            out[name] = t
    return out


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


def replicated_reads(rank: int, tp: int, remote_tp: int) -> List[Tuple[int, None, None]]:
    """The prefill ranks decode rank ``rank`` of ``tp`` reads whole blocks
    from where every rank holds the whole KV (MLA): the same rank; for a
    smaller prefill (``tp = k * remote_tp``) rank ``r // k``, whose lend
    waits for its k readers; for a larger one (``remote_tp = k * tp``)
    ranks ``r*k .. r*k+k-1``, the blocks shared among them in contiguous
    runs (``replicated_shares``), so that every prefill rank's lend is
    read, or released where it has no block to give."""
    if remote_tp == tp:
        return [(rank, None, None)]
    if remote_tp > tp:
        k = remote_tp // tp
        return [(rank * k + j, None, None) for j in range(k)]
    return [(rank // (tp // remote_tp), None, None)]


def replicated_shares(local: List[int], remote: List[int], n: int) -> List[Tuple[List[int], List[int]]]:
    """How ``n`` prefill ranks holding the same KV (MLA) share a read of
    ``remote`` into ``local``: the i-th rank one contiguous share, in order
    (the last ones empty where there are fewer blocks than ranks). A lend
    confirms a read of a run of its blocks, in the order lent, and nothing
    else (``BlocksRead``): each rank's share is such a run."""
    size = -(-len(remote) // n) if remote else 0
    return [(local[j * size : (j + 1) * size], remote[j * size : (j + 1) * size]) for j in range(n)]


def release_ranks(rank: int, tp: int, remote_tp: int, replicated: bool = False) -> List[int]:
    """The prefill ranks decode rank ``rank`` of ``tp`` tells that it will
    not read a request: those it would read (``tp_reads``,
    ``replicated_reads``), each lend so told by as many ranks as read it;
    where neither TP size divides the other (the request refused), the
    prefill ranks ``q`` with ``q mod tp == rank``, so that each is told
    once."""
    if max(tp, remote_tp) % min(tp, remote_tp):
        return [q for q in range(remote_tp) if q % tp == rank]
    if replicated:
        return [q for q, _, _ in replicated_reads(rank, tp, remote_tp)]
    return [q for q, _, _ in tp_reads(rank, tp, remote_tp, 1, 1)]


def tp_mismatch(tp: int, heads: int, block_bytes: int, hs: Handshake, replicated: bool = False) -> Optional[str]:
    """Why this rank (``heads`` KV heads per block, 0 if not outermost;
    ``replicated``: every rank holds the whole KV) cannot read a prefill
    rank whose handshake is ``hs``; None if it can."""
    if replicated or hs.kv_replicated:
        if replicated != hs.kv_replicated:
            return "KV replicated across ranks (MLA) on one side only: not the same model"
        if hs.block_bytes != block_bytes:
            return f"blocks of {hs.block_bytes} bytes, this one {block_bytes}: not the same model layout"
        if max(hs.tp_size, tp) % min(hs.tp_size, tp):
            return f"tp_size {hs.tp_size} and this one's {tp}: one must divide the other"
        return None
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


#: The ledger's block ids, all slots together (4 bytes each): 128 MiB.
LEDGER_ENTRIES = 1 << 25


def ledger_size(num_blocks: int, block_tokens: int, max_model_len: Optional[int]) -> Tuple[int, int]:
    """``(slots, max_blocks)`` for a worker's engine, from vLLM's KV cache:
    a request holds at most ``max_model_len`` tokens and at most every
    block of the cache, so any prompt the cache can hold fits one request
    (times ``MAX_GATHER`` for a decode rank gathering from a larger
    prefill). Slots (requests tracked at once) are 1024, fewer for very
    long contexts, so that the ledger stays within ``LEDGER_ENTRIES``."""
    per_request = num_blocks
    if max_model_len and block_tokens > 0:
        per_request = min(num_blocks, -(-max_model_len // block_tokens))
    max_blocks = max(1, per_request) * MAX_GATHER
    slots = max(64, min(1024, LEDGER_ENTRIES // max_blocks))
    return slots, max_blocks


class LoadState(enum.Enum):
    """Where one decode-side entry of the scheduler's ``reqs_to_recv`` is.

    Loads (vLLM waits for them: the request is ``WAITING_FOR_REMOTE_KVS``)
    go ``HANDSHAKING`` → ``ASKING`` (push only) → ``LOADING`` → reported
    once in ``finished_recving``, finished or failed; or ``FAILED`` (before
    the engine took them) → reported. Releases (the request is gone from
    vLLM: aborted before it was scheduled, or nothing to load) go
    ``HANDSHAKING`` → released, and are never reported: vLLM has freed and
    forgotten them, and a report of one would be for a request it no
    longer tracks."""

    HANDSHAKING = "handshaking"
    ASKING = "asking"
    LOADING = "loading"
    FAILED = "failed"


@dataclass
class _Load:
    """One decode-side entry: a load vLLM waits for, or a release."""

    local_id: str
    remote: Optional[RemotePrefill]
    local_blocks: List[int]
    #: vLLM waits for it (a load): reported once. False: a release.
    reported: bool
    state: LoadState = LoadState.HANDSHAKING
    #: When a load still handshaking fails.
    handshake_until: float = 0.0
    #: Push requests (or releases) in flight on the side channel's pool.
    asks: List["Future[None]"] = field(default_factory=list)
    #: The prefill's blocks to read where they hold another number of
    #: tokens than ours (``LoadSpec.remote_block_ids``).
    remote_blocks: Optional[List[int]] = None
    #: Once read, the groups of local blocks to reorder and the order
    #: (``layout.regroup``).
    regroup: Optional[Tuple[List[List[int]], Any]] = None


class KvpollWorker:
    def __init__(
        self,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        num_blocks: int,
        config: KvpollConfig,
        kv_heads: int = 0,
        block_tokens: int = 0,
        max_model_len: Optional[int] = None,
        kv_replicated: bool = False,
        groups: int = 1,
    ) -> None:
        self.engine_id = engine_id
        #: KV cache groups (vLLM's hybrid KV cache manager makes several):
        #: with more than one, failed loads are reported by request.
        self.groups = groups
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_blocks = num_blocks
        self.config = config
        #: KV heads of this rank per block (vLLM's KV cache spec).
        self.kv_heads = kv_heads
        #: ``(slots, max_blocks)`` of the engine's ledger (``ledger_size``).
        self.ledger = ledger_size(num_blocks, block_tokens, max_model_len)
        self.block_tokens = block_tokens
        #: Every rank holds the whole KV (MLA): see ``replicated_reads``.
        self.kv_replicated = kv_replicated
        #: The order of the elements inside a block (``Handshake.block_layout``);
        #: "" where it is not known.
        self.block_layout = ""
        # The KV cache's layers, and (heads, head size, dtype) of its CPU
        # layout: what blocks of another size are reordered in.
        self._caches: List[Any] = []
        self._cpu_shape: Optional[Tuple[int, int, Any, str]] = None
        # The orders from prefill blocks of a size to ours, by that size.
        self._orders: Dict[int, Any] = {}
        #: ``kv_heads`` if they are outermost in each block, else 0.
        self.block_heads = 0
        self.core: Optional[KvConnectorWorker] = None
        self.num_regions = 0
        self.block_bytes = 0
        self._server: Optional[HandshakeServer] = None
        # The deployment's secret keys the engine and the side channel.
        self._secret = load_secret(config.auth_key_file)
        self._key = SideChannelKey(self._secret) if self._secret is not None else None
        self._handshakes = HandshakeCache(config.handshake_timeout_s, key=self._key)
        self._peers: Dict[Tuple[str, str], int] = {}  # (engine id, instance) -> peer
        # Decode side: loads and releases not finished with, by the
        # prefill's request id (what the engine reports them under).
        self._loads: Dict[str, _Load] = {}
        # Releases still waiting for handshakes, and loads still waiting for
        # handshakes or push answers: what each step moves on (the loads
        # the engine has are left to its reports, not looked at each step).
        self._releases: List[_Load] = []
        self._waiting: List[_Load] = []
        # Loads that failed before the engine saw them: reported next step.
        self._failed_now: Set[str] = set()
        self._failed_blocks: Set[int] = set()
        # Loads that failed since vLLM last asked, by local request id.
        self._failed_loads: Set[str] = set()
        # Lends the engine refused: free at once.
        self._unlent: Set[str] = set()
        # The engine was found deaf and that was logged (once).
        self._deaf_logged = False
        self.instance = new_instance()
        # Push mode, prefill side: finished requests' blocks awaiting their
        # decode ranks' push requests (until the lease ends), push requests
        # and releases (from the side channel's threads) awaiting their
        # request.
        self._pushes: Dict[str, Tuple[List[int], float]] = {}
        self._asks: Dict[str, List[Tuple[PushRequest, float]]] = {}
        self._frees: Dict[str, float] = {}
        self._asks_lock = threading.Lock()
        self._stats = _Stats()

    # ------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        # Layers of different KV cache groups share one tensor (vLLM's
        # hybrid KV cache manager: a block belongs to one group at a time,
        # and holds that group's layer): each tensor is registered once.
        kv_caches = distinct_tensors(kv_caches)
        regions, self.block_bytes = kv_cache_regions(kv_caches, self.num_blocks)
        if heads_outermost(kv_caches, self.num_blocks, self.kv_heads):
            self.block_heads = self.kv_heads
        self._cpu_layout(kv_caches)
        self.num_regions = sum(len(r) for r in regions.values())
        slots, max_blocks = self.ledger
        kwargs: Dict[str, Any] = {
            "idle": self.config.idle,
            "read_deadline_s": self.config.read_deadline_s,
            # The prefill lends at its worker's next step, which may come
            # seconds after its response (a long batch, a stalled engine):
            # a read whose data landed waits for the lend as long as a
            # read may take.
            "lend_grace_s": self.config.read_deadline_s,
            "slots": slots,
            "max_blocks": max_blocks,
            "remote_write": self.config.remote_write,
            "auth_key": self._secret,
        }
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
                block_layout=self.block_layout,
                kv_replicated=self.kv_replicated,
            )
            self._server = HandshakeServer(
                self.config.side_channel_host,
                self.config.side_channel_port + self.tp_rank,
                hs,
                self._on_push,
                self._on_free,
                self._key,
            )
        except BaseException:
            core.shutdown()
            raise
        self.core = core
        logger.info(
            "kvpoll: %d regions of %d blocks of %d bytes (up to %d blocks a request, %d requests); "
            "handshakes on %s:%d",
            self.num_regions, self.num_blocks, self.block_bytes, max_blocks // MAX_GATHER, slots,
            *self._server.address,
        )

    def _cpu_layout(self, kv_caches: Mapping[str, Any]) -> None:
        """Names the order inside this cache's blocks where it is vLLM's CPU
        layout (``[num_blocks, kv_heads, block_tokens, 2 * head]`` in host
        memory): the attention kernels' instruction set, which decides it."""
        shapes = {(tuple(t.shape), t.dtype, getattr(t.device, "type", "cpu")) for t in kv_caches.values()}
        if len(shapes) != 1 or not self.block_tokens:
            return
        shape, dtype, device = shapes.pop()
        if device != "cpu" or len(shape) != 4 or shape[0] != self.num_blocks or shape[2] != self.block_tokens:
            return
        if shape[3] % 2:
            return
        isa = attention_isa(dtype, self.block_tokens, shape[3] // 2)
        if isa is None:
            return
        self.block_layout = f"cpu_attn/{isa}"
        self._caches = list(kv_caches.values())
        self._cpu_shape = (shape[1], shape[3] // 2, dtype, isa)

    def _order_from(self, remote_tokens: int, hs: Handshake) -> Any:
        """The order that turns blocks of ``remote_tokens`` tokens laid out
        as ``hs`` says into ours (computed once per size). Raises
        ``HandshakeError`` where they cannot be reordered."""
        order = self._orders.get(remote_tokens)
        if order is not None:
            return order
        if self._cpu_shape is None:
            raise HandshakeError("this worker's KV cache is not vLLM's CPU layout: blocks of another size are not reordered")
        heads, head_size, dtype, own_isa = self._cpu_shape
        isa = attention_isa(dtype, remote_tokens, head_size)
        if isa is None or hs.block_layout != f"cpu_attn/{isa}":
            raise HandshakeError(
                f"blocks of {remote_tokens} tokens laid out as {hs.block_layout or 'unknown'!r}; "
                f"this vLLM lays them out as {'cpu_attn/' + isa if isa else 'unknown'!r}"
            )
        try:
            order = group_order(
                element_offsets(dtype, remote_tokens, heads, head_size, isa),
                remote_tokens,
                element_offsets(dtype, self.block_tokens, heads, head_size, own_isa),
                self.block_tokens,
            )
        except (ValueError, RuntimeError) as e:
            raise HandshakeError(f"blocks of {remote_tokens} tokens cannot be reordered into {self.block_tokens}: {e}") from e
        self._orders[remote_tokens] = order
        return order

    # ------------------------------------------------------------ steps

    def start_load_kv(self, meta: KvpollConnectorMetadata) -> None:
        """Takes this step's lends and loads. Nothing here waits on the
        network: a load whose prefill's handshake is not known yet waits
        for it across steps (fetched in the background)."""
        assert self.core is not None, "register_kv_caches first"
        readers = self.config.readers_per_lend(self.tp_size)
        for req_id, (blocks, inc) in meta.reqs_to_send.items():
            if self.config.mode == "push":
                # Written once its decode ranks asked, or freed at the lease's end.
                self._pushes[req_id] = (list(blocks), time.monotonic() + self.config.lease_s)
                continue
            logger.debug("kvpoll: lending %s (blocks %s, %d readers)", req_id, blocks, readers)
            try:
                self.core.start_load_kv(reqs_to_send={req_id: (blocks, readers, inc)})
            except KvpollError as e:
                # Refused (not busy): nothing lent, so nothing holds the
                # blocks. Its release is this step's (vLLM lends only
                # requests it finished), so it is reported this step.
                logger.error("kvpoll: lend of %s refused, its blocks are freed: %s", req_id, e)
                self._unlent.add(req_id)
        for req_id, spec in meta.reqs_to_recv.items():
            self._take(req_id, spec)
        self._advance()
        self._write_asked()

    def _take(self, req_id: str, spec: LoadSpec) -> None:
        """A new entry of ``reqs_to_recv``: a load if it has blocks to
        fill (vLLM waits for it), else a release."""
        load = _Load(req_id, spec.remote, list(spec.local_block_ids), reported=bool(spec.local_block_ids))
        load.remote_blocks = spec.remote_block_ids
        load.handshake_until = time.monotonic() + HANDSHAKE_BOUND * self.config.handshake_timeout_s
        if spec.error is not None or spec.remote is None:
            self._end(load, spec.error or "no remote")
            return
        if not load.reported:
            if spec.remote.mode == "push":
                self._release_push(load)
            else:
                self._releases.append(load)
            return
        rid = spec.remote.request_id
        loading = self._loads.get(rid)
        if loading is not None:
            if loading.local_id == req_id:
                # The same load again: its one report covers it.
                logger.warning("kvpoll: %s is loading already; the second load is dropped", req_id)
            else:
                self._end(load, f"{rid} is being loaded by {loading.local_id}")
            return
        self._loads[rid] = load
        self._waiting.append(load)

    def _advance(self) -> None:
        """Moves each entry waiting for handshakes or push answers on, as
        far as what has arrived allows."""
        if self._releases:
            self._releases = [r for r in self._releases if not self._advance_release(r)]
        if self._waiting:
            self._waiting = [load for load in self._waiting if self._advance_waiting(load)]

    def _advance_waiting(self, load: _Load) -> bool:
        """Moves one load on; True while it still waits."""
        if load.state is LoadState.HANDSHAKING:
            self._advance_load(load)
        if load.state is LoadState.ASKING:
            self._check_asks(load)
        return load.state in (LoadState.HANDSHAKING, LoadState.ASKING)

    def _ready_plan(self, load: _Load) -> Optional[list]:
        """The load's plan (remote rank, peer, byte ranges) once every
        handshake it needs is in; None while one is pending. Raises
        ``HandshakeError`` or ``KvpollError`` if one failed or does not fit."""
        remote = load.remote
        assert remote is not None
        ranks = self._plan(remote)
        if ranks is None:
            return None
        hss = self._handshakes_of(load, [r for r, _, _ in ranks])
        if hss is None:
            return None
        return [(rank, self._peer(remote, rank, hs), lb, rb) for (rank, lb, rb), hs in zip(ranks, hss)]

    def _handshakes_of(self, load: _Load, ranks: List[int]) -> Optional[List[Handshake]]:
        """The handshakes of the load's prefill ``ranks`` once all are in;
        None while one is pending. Raises ``HandshakeError`` if one failed
        or is still pending past the load's bound."""
        remote = load.remote
        assert remote is not None
        hss = [self._handshakes.poll(remote.engine_id, remote.host, remote.port, r) for r in ranks]
        if all(hs is not None for hs in hss):
            return hss  # type: ignore[return-value]
        if time.monotonic() > load.handshake_until:
            raise HandshakeError(
                f"engine {remote.engine_id!r} at {remote.host}:{remote.port}: handshake still pending after "
                f"{HANDSHAKE_BOUND * self.config.handshake_timeout_s:g} s"
            )
        return None

    def _advance_release(self, load: _Load) -> bool:
        """A pull release: once its handshakes are in, tells the prefill
        ranks it will not read. True when done with (sent or given up)."""
        remote = load.remote
        assert remote is not None and self.core is not None
        try:
            ranks = release_ranks(self.tp_rank, self.tp_size, remote.tp_size, self.kv_replicated)
            hss = self._handshakes_of(load, ranks)
            if hss is None:
                return False
            # Nothing is read: the layouts need not fit, only the engine be known.
            peers = [self._peer(remote, rank, hs, check=False) for rank, hs in zip(ranks, hss)]
            self.core.engine.notify_only(remote.request_id, [(peer, remote.incarnation) for peer in peers])
        except (HandshakeError, KvpollError) as e:
            logger.warning("kvpoll: release of %s at %s not sent: %s", remote.request_id, remote.engine_id, e)
        return True

    def _release_push(self, load: _Load) -> None:
        """A push release: tells each prefill rank this rank would have
        asked that nobody will ask (on the side channel's pool)."""
        remote = load.remote
        assert remote is not None
        rel = PushRelease(engine_id=remote.engine_id, request_id=remote.request_id)
        for rank in release_ranks(self.tp_rank, self.tp_size, remote.tp_size, self.kv_replicated):
            fut = self._handshakes.submit(
                send_push_release, remote.host, remote.port + rank, rank, rel, self.config.handshake_timeout_s, self._key
            )
            fut.add_done_callback(partial(_log_release, remote.request_id, rank))

    def _advance_load(self, load: _Load) -> None:
        remote = load.remote
        assert remote is not None and self.core is not None
        try:
            plan = self._ready_plan(load)
        except (HandshakeError, KvpollError) as e:
            self._end(load, str(e))
            return
        if plan is None:
            return
        unread: List[Tuple[int, int]] = []
        if load.remote_blocks is not None:
            try:
                handles = self._regrouped(load, plan)
            except (HandshakeError, ValueError) as e:
                self._end(load, str(e))
                return
        else:
            if remote.mode == "push":
                per_block = sum((lb[1] - lb[0]) if lb else self.block_bytes for _, _, lb, _ in plan)
                self._stats.started(remote.request_id, len(load.local_blocks) * per_block * self.num_regions)
                self._ask_push(load, plan)
                return
            remote_blocks = list(remote.block_ids[len(remote.block_ids) - len(load.local_blocks) :])
            if self.kv_replicated and len(plan) > 1:
                # Whole blocks shared among prefill ranks holding the same KV.
                shares = replicated_shares(load.local_blocks, remote_blocks, len(plan))
                handles = [
                    (peer, lb, rb, remote.incarnation) for (_, peer, _, _), (lb, rb) in zip(plan, shares)
                ]
            else:
                handles = [
                    (peer, load.local_blocks, remote_blocks, remote.incarnation, *((lb, rb) if lb else ()))
                    for _, peer, lb, rb in plan
                ]
            unread = [(h[0], h[3]) for h in handles if not h[1]]
            handles = [h for h in handles if h[1]]
        moved = sum(len(h[1]) * ((h[4][1] - h[4][0]) if len(h) > 4 else self.block_bytes) for h in handles)
        self._stats.started(remote.request_id, moved * self.num_regions)
        logger.debug("kvpoll: reading %s from %d ranks", remote.request_id, len(handles))
        try:
            self.core.start_load_kv(reqs_to_recv={remote.request_id: handles})
        except (KvpollError, KeyError, ValueError) as e:
            self._end(load, f"read refused: {e}")
            return
        load.state = LoadState.LOADING
        if unread:
            # Prefill ranks with no block to give this rank: released now,
            # not at their lease's end.
            try:
                self.core.engine.notify_only(remote.request_id, unread)
            except KvpollError as e:
                logger.warning("kvpoll: release of %s's unread ranks not sent: %s", remote.request_id, e)

    def _regrouped(self, load: _Load, plan: list) -> List[tuple]:
        """The part reads of a load whose prefill blocks hold another
        number of tokens than ours (the same TP size: one prefill rank):
        each prefill block's bytes whole and in token order across the
        local blocks of its group, reordered once read (``get_finished``)."""
        remote = load.remote
        assert remote is not None and load.remote_blocks is not None
        if len(plan) != 1 or plan[0][2] is not None:
            raise HandshakeError("different block sizes are loaded between equal tensor-parallel sizes only")
        rank, peer, _, _ = plan[0]
        hs = self._handshakes.poll(remote.engine_id, remote.host, remote.port, rank)
        assert hs is not None  # the plan is ready: its handshake is in
        order = self._order_from(remote.block_size, hs)
        reads, groups = block_plan(
            load.local_blocks, load.remote_blocks, self.block_tokens, remote.block_size, self.block_bytes, hs.block_bytes
        )
        load.regroup = (groups, order)
        return [(peer, lb, rb, remote.incarnation, lr, rr) for lb, rb, lr, rr in reads if lb]

    def _end(self, load: _Load, why: str) -> None:
        """Ends an entry before the engine has it: a load fails (reported
        next ``get_finished``, its blocks invalid), a release is dropped."""
        if load.remote is not None and self._loads.get(load.remote.request_id) is load:
            del self._loads[load.remote.request_id]
        if not load.reported:
            logger.warning("kvpoll: release of %s not sent: %s", load.local_id, why)
            return
        logger.warning("kvpoll: load of %s failed: %s", load.local_id, why)
        load.state = LoadState.FAILED
        self._failed_now.add(load.local_id)
        self._failed(load)
        self._stats.failed(load.remote.request_id if load.remote else load.local_id)

    # ------------------------------------------------------------ push

    def _ask_push(self, load: _Load, plan: list) -> None:
        """Push mode, decode side: lends the load's blocks to the prefill
        ranks of ``plan`` as writers, then asks each (on the side
        channel's pool) to write its share. The engine reports the lend
        once (every writer done, or failed): as a load."""
        remote = load.remote
        assert remote is not None and self.core is not None
        local = load.local_blocks
        inc = draw_incarnation()
        try:
            self.core.start_load_kv(reqs_to_recv_push={remote.request_id: (local, len(plan), inc)})
        except KvpollError as e:
            self._end(load, f"push destination refused: {e}")
            return
        load.state = LoadState.ASKING
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
            load.asks.append(
                self._handshakes.submit(
                    send_push_request, remote.host, remote.port + rank, rank, ask, self.config.handshake_timeout_s, self._key
                )
            )

    def _check_asks(self, load: _Load) -> None:
        """A push load whose requests were sent: once all were answered it
        is the engine's; one refused or lost aborts the destination, which
        the engine then reports failed once no writer can still write."""
        if not all(f.done() for f in load.asks):
            return
        errors = [f.exception() for f in load.asks if f.exception() is not None]
        load.asks = []
        load.state = LoadState.LOADING
        if errors:
            assert load.remote is not None and self.core is not None
            logger.warning("kvpoll: push of %s not asked, the load fails: %s", load.local_id, errors[0])
            try:
                self.core.engine.abort(load.remote.request_id)
            except KvpollError:
                pass

    def _on_push(self, ask: PushRequest) -> Optional[str]:
        """A decode rank's push request (on a side-channel thread)."""
        if ask.engine_id != self.engine_id:
            return f"this is engine {self.engine_id!r}, not {ask.engine_id!r}"
        if self.config.mode != "push":
            return "this prefill lends its blocks to readers (mode pull)"
        with self._asks_lock:
            if sum(len(v) for v in self._asks.values()) >= MAX_PENDING_PUSH_REQUESTS:
                return f"{MAX_PENDING_PUSH_REQUESTS} push requests pending"
            self._asks.setdefault(ask.request_id, []).append((ask, time.monotonic()))
        return None

    def _on_free(self, rel: PushRelease) -> None:
        """A decode rank's release of a push it will not ask for (on a
        side-channel thread): the blocks are freed next step."""
        if rel.engine_id != self.engine_id:
            raise HandshakeError(f"this is engine {self.engine_id!r}, not {rel.engine_id!r}")
        if self.config.mode != "push":
            raise HandshakeError("this prefill lends its blocks to readers (mode pull): release it by notification")
        with self._asks_lock:
            if len(self._frees) >= MAX_PENDING_PUSH_REQUESTS:
                raise HandshakeError(f"{MAX_PENDING_PUSH_REQUESTS} releases pending")
            self._frees[rel.request_id] = time.monotonic()

    def _write_asked(self) -> None:
        """Push mode, prefill side: writes each finished request every one
        of its decode ranks asked for; frees those released by their
        decode and those nobody asked for in the lease (their decode fails
        its load when its own lease ends), and forgets requests and
        releases for requests it does not hold."""
        if self.config.mode != "push" or self.core is None:
            return
        now = time.monotonic()
        readers = self.config.readers_per_lend(self.tp_size)
        ready: List[Tuple[str, List[PushRequest]]] = []
        with self._asks_lock:
            for req_id in [r for r in self._frees if r in self._pushes]:
                del self._frees[req_id]
                self._asks.pop(req_id, None)
                del self._pushes[req_id]
                logger.debug("kvpoll: %s released by its decode, its blocks are freed", req_id)
                self._unlent.add(req_id)
            for req_id in [r for r, t in self._frees.items() if now - t >= self.config.lease_s]:
                del self._frees[req_id]
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

    def _reads(self, remote_tp: int, block_bytes: int, remote_block_bytes: int) -> list:
        """``tp_reads``, or ``replicated_reads`` where every rank holds the whole KV."""
        if self.kv_replicated:
            return replicated_reads(self.tp_rank, self.tp_size, remote_tp)
        return tp_reads(self.tp_rank, self.tp_size, remote_tp, block_bytes, remote_block_bytes)

    def _plan(self, remote: RemotePrefill) -> Optional[list]:
        """The remote ranks this rank reads a load from, and the byte
        ranges of each block (see ``tp_reads``); None while the first
        rank's handshake (which says the prefill's block size) is pending."""
        if max(remote.tp_size, self.tp_size) % min(remote.tp_size, self.tp_size):
            raise HandshakeError(f"prefill tp_size {remote.tp_size}, decode {self.tp_size}: one must divide the other")
        first = min(self.tp_rank * remote.tp_size // self.tp_size, remote.tp_size - 1)
        hs = self._handshakes.poll(remote.engine_id, remote.host, remote.port, first)
        if hs is None:
            return None
        return self._reads(remote.tp_size, self.block_bytes, hs.block_bytes)

    def _peer(self, remote: RemotePrefill, rank: int, hs: Handshake, check: bool = True) -> int:
        """The engine peer of prefill rank ``rank``, added once; with
        ``check``, a ``HandshakeError`` if its blocks cannot be read here."""
        engine_id = remote.engine_id
        if not check:
            why = None
        elif hs.num_regions != self.num_regions:
            why = f"{hs.num_regions} regions, this one {self.num_regions}: not the same model layout"
        elif hs.tp_size != remote.tp_size:
            why = f"tp_size {hs.tp_size}, the request says {remote.tp_size}"
        elif remote.block_size and self.block_tokens and remote.block_size != self.block_tokens:
            # Reordered once read (``_regrouped``): the same bytes a token.
            if hs.block_bytes * self.block_tokens != self.block_bytes * remote.block_size:
                why = (
                    f"blocks of {hs.block_bytes} bytes for {remote.block_size} tokens, this one "
                    f"{self.block_bytes} for {self.block_tokens}: not the same model layout"
                )
            else:
                why = None
        elif hs.block_layout and self.block_layout and hs.block_layout != self.block_layout:
            # The same sizes, another order inside: its bytes would be
            # read as other tokens' keys.
            why = f"blocks laid out as {hs.block_layout!r}, this one {self.block_layout!r}"
        else:
            why = tp_mismatch(self.tp_size, self.block_heads, self.block_bytes, hs, self.kv_replicated)
        if why is not None:
            self._handshakes.forget(engine_id)
            raise HandshakeError(f"engine {engine_id!r} rank {rank}: {why}")
        key = (engine_id, hs.instance)
        peer = self._peers.get(key)
        if peer is None:
            peer = self.core.engine.add_peer(hs.metadata, any_block_size=hs.block_bytes != self.block_bytes)
            self._peers[key] = peer
        return peer

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """``(sending, recving)`` as vLLM wants them: ``recving`` holds
        only loads (requests vLLM waits for), each once, never a release."""
        assert self.core is not None
        self._advance()
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
            load = self._loads.pop(remote_id, None)
            if load is None:
                # Not a load of this worker's (the engine reports only what
                # was submitted, so this is a bug): never hand vLLM an id
                # it may not track.
                logger.error("kvpoll: the engine reported %s, which this worker does not load", remote_id)
                continue
            done.add(load.local_id)
            reason = self.core.failure_reasons.get(remote_id)
            if reason is not None:
                logger.warning(
                    "kvpoll: load of %s (%s at engine %s) failed: %s (transport status %d)",
                    load.local_id, remote_id, load.remote.engine_id if load.remote else "?", *reason,
                )
                self._stats.failed(remote_id)
                if self.groups > 1:
                    self._failed_loads.add(load.local_id)
                # The remote may be a new instance now: ask again next time.
                if load.remote is not None:
                    self._handshakes.forget(load.remote.engine_id)
            elif not self._reorder(load):
                self._stats.failed(remote_id)
            else:
                logger.debug("kvpoll: load of %s (%s) finished", load.local_id, remote_id)
                self._stats.finished(remote_id)
        return sending, (done or None)

    def _reorder(self, load: _Load) -> bool:
        """A load read in the prefill's block order (another block size)
        put in ours before vLLM sees its blocks; False, its blocks
        reported invalid, if that failed."""
        if load.regroup is None:
            return True
        try:
            regroup(self._caches, *load.regroup)
        except Exception as e:  # noqa: BLE001 - never into vLLM's step
            logger.error("kvpoll: load of %s read but not reordered, its blocks are invalid: %s", load.local_id, e)
            self._failed(load)
            return False
        return True

    def _failed(self, load: _Load) -> None:
        """A load that failed before or after the engine's report: its
        blocks are invalid, and the request's load failed."""
        self._failed_blocks.update(load.local_blocks)
        if self.groups > 1:
            self._failed_loads.add(load.local_id)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """The blocks of loads that failed since the last call; none where
        the KV cache has several groups (``take_failed_loads`` says which
        requests instead)."""
        out = self._failed_blocks
        self._failed_blocks = set()
        if self.core is not None:
            out |= self.core.get_block_ids_with_load_errors()
        return out if self.groups == 1 else set()

    def take_failed_loads(self) -> Set[str]:
        """The requests whose load failed since the last call, where the KV
        cache has several groups (vLLM fails or recomputes each whole);
        none with one group, whose failed blocks say it."""
        out = self._failed_loads
        self._failed_loads = set()
        return out

    def get_kv_connector_stats(self) -> Optional[Dict[str, Any]]:
        refused = self._key.take_refused() if self._key is not None else 0
        if self.core is not None:
            s = self.core.engine.poller_stats()
            refused += self._stats.engine_refusals(
                s["unauthenticated_peers"] + s["unauthenticated_notifications"] + s["replayed_notifications"]
            )
        self._stats.data["num_unauthenticated"] += refused
        return self._stats.take()

    @property
    def loads(self) -> Dict[str, LoadState]:
        """Each load not yet reported, by vLLM's request id: its state."""
        return {load.local_id: load.state for load in self._loads.values()}

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self._handshakes.close()
        if self.core is not None:
            self.core.shutdown()
            self.core = None


def _log_release(request_id: str, rank: int, fut: "Future[None]") -> None:
    e = fut.exception()
    if e is not None:
        logger.warning("kvpoll: release of %s at prefill rank %d not delivered: %s", request_id, rank, e)


class _Stats:
    """Transfers, failures, bytes and durations since the last take()."""

    def __init__(self) -> None:
        self._started: Dict[str, Tuple[float, int]] = {}
        # The engine's refusals as unauthenticated counted so far.
        self._engine_refused = 0
        self._reset()

    def _reset(self) -> None:
        self.data: Dict[str, Any] = {
            "num_transfers": 0,
            "num_failed": 0,
            "bytes": 0,
            "durations_s": [],
            "num_unauthenticated": 0,
        }

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

    def engine_refusals(self, total: int) -> int:
        """The engine's refusals as unauthenticated since the last call, of
        its running ``total``."""
        new, self._engine_refused = total - self._engine_refused, total
        return new

    def take(self) -> Optional[Dict[str, Any]]:
        if not (self.data["num_transfers"] or self.data["num_failed"] or self.data["num_unauthenticated"]):
            return None
        out = self.data
        self._reset()
        return out
