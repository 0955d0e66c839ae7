"""Type stubs of the kvpoll extension module (``kvpoll._kvpoll``), re-exported
by ``kvpoll``."""

from types import TracebackType
from typing import Dict, Iterable, List, Literal, Optional, Sequence, Set, Tuple, Type, Union

RequestId = Union[str, int]
"""A request id: a ``str`` (as vLLM's) or an ``int`` in ``0..2**63``."""

Handle = Union[
    "Transfer",
    Tuple[int, Sequence[int], Sequence[int]],
    Tuple[int, Sequence[int], Sequence[int], int],
    Tuple[int, Sequence[int], Sequence[int], int, Tuple[int, int], Tuple[int, int]],
]
"""One handle of a read or write: a ``Transfer`` or ``(peer, local, remote)``,
``(peer, local, remote, lend)`` or ``(peer, local, remote, lend,
local_bytes, remote_bytes)``."""

class KvpollError(Exception):
    """Base class of every error the kvpoll engine reports."""

class ConfigError(KvpollError, ValueError):
    """The engine's settings are invalid."""

class RegionError(KvpollError, ValueError):
    """A region does not fit the layout, or none is registered yet."""

class RequestError(KvpollError, ValueError):
    """A request was refused; nothing was submitted."""

class PeerError(KvpollError, ValueError):
    """Peer metadata was refused, or the peer is not known."""

class BusyError(KvpollError):
    """Every request slot or the command ring is full: poll, then retry."""

class TransportError(KvpollError):
    """A UCX call failed."""

class ShutdownError(KvpollError):
    """The engine is shut down (or its poller died)."""

def draw_incarnation() -> int:
    """A fresh lend incarnation (64 random bits, never 0)."""
def request_id(req_id: RequestId) -> int:
    """kvpoll's 64-bit id for a request id: an int is itself, a str the
    FNV-1a hash of its UTF-8 bytes with the top bit set."""

def ucx_version() -> Dict[str, object]:
    """The UCX in use: ``loaded`` (what the loaded library reports),
    ``built`` (what the extension was built against), ``source``
    (``pkg-config``, ``prefix`` or ``wheel``), ``libdir``, ``compatible``
    (whether engines can start on it) and ``cuda`` (whether it can
    register CUDA memory)."""

def device_memory() -> Dict[str, object]:
    """Whether CUDA tensors can be registered here: ``cuda_build`` (the
    extension has the cuda feature), ``driver`` (the CUDA driver loads),
    ``ucx_cuda`` (the loaded UCX has CUDA transports) and ``refusal`` (why
    ``register_buffer`` refuses a CUDA array, naming what is missing;
    ``None`` when it accepts them)."""

class Transfer:
    """One handle: ``local[i]`` of this engine pairs with ``remote[i]`` of
    ``peer``, in the remote lend of incarnation ``lend``; with
    ``local_bytes``/``remote_bytes`` (``(start, end)`` within each block)
    only that part of every block moves."""

    def __init__(
        self,
        peer: int,
        local: Iterable[int],
        remote: Iterable[int],
        lend: int = 0,
        local_bytes: Optional[Tuple[int, int]] = None,
        remote_bytes: Optional[Tuple[int, int]] = None,
    ) -> None: ...
    @property
    def local_bytes(self) -> Optional[Tuple[int, int]]: ...
    @property
    def remote_bytes(self) -> Optional[Tuple[int, int]]: ...
    @property
    def peer(self) -> int: ...
    @property
    def lend(self) -> int: ...
    @property
    def local(self) -> List[int]: ...
    @property
    def remote(self) -> List[int]: ...

class PollResult:
    """What one ``Engine.poll()`` reported. Each request appears once over
    the engine's life in exactly one of ``finished_recving``,
    ``finished_sending``, ``failed_recving`` and ``expired``."""

    @property
    def finished_recving(self) -> Set[RequestId]:
        """Reads (and receives) whose data is all here."""
    @property
    def finished_sending(self) -> Set[RequestId]:
        """Writes acknowledged, lends released: source blocks are free."""
    @property
    def expired(self) -> Set[RequestId]:
        """Writes and lends whose lease ended first: blocks free, not done."""
    @property
    def failed_recving(self) -> Dict[RequestId, List[int]]:
        """Failed receives -> local block ids whose contents are invalid."""
    @property
    def failed_sending(self) -> Dict[RequestId, Tuple[str, int]]:
        """Failed or aborted writes -> (cause, transport status); never done."""
    @property
    def failure_reasons(self) -> Dict[RequestId, Tuple[str, int]]:
        """Failed receives -> (cause, transport status)."""
    @property
    def handle_failures(self) -> List[Tuple[RequestId, int, str, int]]:
        """Informational: (id, handle index, cause, status) per failed handle."""
    def __len__(self) -> int: ...

class Engine:
    """A kvpoll engine: a poller thread that owns the UCX worker; submit
    transfers, and ``poll()`` for reports every engine step."""

    def __init__(
        self,
        block_size: int = 16384,
        *,
        core: Optional[int] = None,
        idle: Literal["adaptive", "busy"] = "adaptive",
        read_deadline_s: float = 30.0,
        lend_grace_s: Optional[float] = None,
        tls: Optional[str] = None,
        slots: int = 1024,
        max_blocks: int = 512,
        confirm_reads: bool = True,
        remote_write: bool = True,
        auth_key: Optional[bytes] = None,
    ) -> None: ...
    def register(self, n_blocks: int) -> int:
        """Registers a region of ``n_blocks`` blocks the engine allocates; returns its index."""
    def register_buffer(self, obj: Union[object, Tuple[int, int]]) -> int:
        """Registers a writable C-contiguous buffer, a ``(ptr, nbytes)``
        pair, or a contiguous CUDA tensor or array (registered as device
        memory; refused, saying what is missing, unless
        ``device_memory()["refusal"]`` is ``None``) as a region; returns
        its index."""
    def local_metadata(self) -> bytes:
        """This engine's metadata, for the peers' ``add_peer``."""
    def add_peer(self, metadata: bytes, any_block_size: bool = False) -> int:
        """Adds a peer from its metadata; returns its peer id. With
        ``any_block_size`` its blocks may be of another size (only part
        handles reach it then)."""
    def remove_peer(self, peer: int) -> None:
        """Removes a peer; its handles in flight fail."""
    def read(
        self,
        req_id: RequestId,
        handles: Iterable[Handle],
        deadline_s: Optional[float] = None,
    ) -> None:
        """Pull: reads the handles; reported finished or failed (once)."""
    def notify_only(self, req_id: RequestId, producers: Iterable[Tuple[int, int]]) -> None:
        """Nothing to read: each producer releases its lend of ``req_id``."""
    def write(
        self,
        req_id: RequestId,
        handles: Iterable[Handle],
        expected_acks: int = 1,
        lease_s: float = 30.0,
    ) -> None:
        """Push: writes into blocks lent to writers; done after the acks."""
    def lend(
        self,
        req_id: RequestId,
        blocks: Iterable[int],
        *,
        readers: int,
        lease_s: float = 30.0,
        incarnation: Optional[int] = None,
    ) -> int:
        """Pull: lends blocks to remote readers until they notified;
        returns the lend's incarnation."""
    def receive(
        self,
        req_id: RequestId,
        blocks: Iterable[int],
        *,
        writers: int,
        lease_s: float = 30.0,
        incarnation: Optional[int] = None,
    ) -> int:
        """Push: opens a receive that remote writers write into and
        notify; returns the receive's incarnation."""
    def heartbeat(self, ids: Iterable[RequestId], extend_s: float) -> None:
        """Extends the leases of these writes or lends."""
    def abort(self, req_id: RequestId) -> None:
        """Aborts a request in flight; reported failed once quiescent."""
    def poll(self) -> PollResult:
        """What happened since the last poll."""
    def shutdown(self) -> None:
        """Stops the poller; requests in flight are reported by the next poll."""
    def write_block(self, region: int, block: int, data: bytes) -> None:
        """Copies data (at most a block) into a block."""
    def read_block(self, region: int, block: int) -> bytes:
        """A block's bytes."""
    @property
    def block_size(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def is_deaf(self) -> bool:
        """Whether the engine's UCX worker receives no message again (a peer
        killed inside a shared-memory send to it): new requests fail; build
        a new engine."""
    @property
    def is_shut_down(self) -> bool: ...
    def poller_stats(self) -> Dict[str, int]:
        """The poller's counters, among them what was refused as
        unauthenticated (``unauthenticated_peers``,
        ``unauthenticated_notifications``, ``replayed_notifications``)."""
    def __enter__(self) -> "Engine": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...
