"""What the scheduler half tells the worker half each step, and the
``kv_transfer_params`` a prefill hands to its decode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

#: The key of the lend's incarnation in ``kv_transfer_params`` (a hex
#: string: a 64-bit integer does not survive every JSON proxy).
INCARNATION_KEY = "kvpoll_incarnation"
#: The key of how many decode ranks read each prefill rank's lend.
READERS_KEY = "kvpoll_readers"
#: The key of the prefill's transfer mode ("pull" or "push").
MODE_KEY = "kvpoll_mode"


class TransferParamsError(ValueError):
    """``kv_transfer_params`` that name no readable remote prefill."""


def remote_block_ids(blocks: Any) -> Tuple[Tuple[int, ...], ...]:
    """The prefill's block ids from ``remote_block_ids``, one tuple per KV
    cache group: one list per group (``[[...], ...]``, as NixlConnector
    names them and kvpoll's prefill answers) or one flat list (kvpoll's
    earlier params: one group). Block ids are the engine's, 32 bits, and
    one pool serves every group: a block named twice is refused."""
    if not (isinstance(blocks, (list, tuple)) and blocks and all(isinstance(g, (list, tuple)) for g in blocks)):
        blocks = [blocks]
    groups = []
    for g in blocks:
        if not isinstance(g, (list, tuple)) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2**32 for b in g
        ):
            raise TransferParamsError(f"kv_transfer_params['remote_block_ids'] not a list of block ids: {g!r}")
        groups.append(tuple(g))
    named = [b for g in groups for b in g]
    if len(set(named)) != len(named):
        raise TransferParamsError("kv_transfer_params['remote_block_ids'] names a block twice")
    return tuple(groups)


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode reads a request's KV from, parsed from the
    ``kv_transfer_params`` of the prefill's response."""

    engine_id: str
    request_id: str
    host: str
    port: int
    tp_size: int
    #: Every block the prefill lent, group after group (one group: its
    #: blocks in token order).
    block_ids: Tuple[int, ...]
    incarnation: int
    #: Decode ranks each prefill rank's lend waits for.
    readers: int = 1
    #: "pull": read the prefill's lend; "push": lend to the prefill's writes.
    mode: str = "pull"
    #: Tokens a prefill block holds (``remote_block_size``, NIXL's key);
    #: 0 where the params do not say.
    block_size: int = 0
    #: The lent blocks of each KV cache group, in token order (a
    #: sliding-window group's: the window's only); empty: one group,
    #: ``block_ids``.
    groups: Tuple[Tuple[int, ...], ...] = ()

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "RemotePrefill":
        def need(key: str, kind: type) -> Any:
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise TransferParamsError(f"kv_transfer_params[{key!r}] missing or not {kind.__name__}: {value!r}")
            return value

        groups = remote_block_ids(params.get("remote_block_ids"))
        inc = params.get(INCARNATION_KEY)
        try:
            incarnation = int(inc, 16) if isinstance(inc, str) else -1
        except ValueError:
            incarnation = -1
        if not 0 < incarnation < 2**64:
            raise TransferParamsError(f"kv_transfer_params[{INCARNATION_KEY!r}] not a lend incarnation: {inc!r}")
        port = need("remote_port", int)
        if not 0 < port < 65536:
            raise TransferParamsError(f"kv_transfer_params['remote_port'] out of range: {port}")
        tp_size = need("tp_size", int)
        if tp_size <= 0:
            raise TransferParamsError(f"kv_transfer_params['tp_size'] must be positive: {tp_size}")
        readers = params.get(READERS_KEY, 1)
        if not isinstance(readers, int) or isinstance(readers, bool) or readers <= 0:
            raise TransferParamsError(f"kv_transfer_params[{READERS_KEY!r}] not a positive int: {readers!r}")
        block_size = params.get("remote_block_size")
        if block_size is None:  # not named, or null as NIXL allows
            block_size = 0
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 0:
            raise TransferParamsError(f"kv_transfer_params['remote_block_size'] not a block size: {block_size!r}")
        mode = params.get(MODE_KEY, "pull")
        if mode not in ("pull", "push"):
            raise TransferParamsError(f"kv_transfer_params[{MODE_KEY!r}] not 'pull' or 'push': {mode!r}")
        return cls(
            engine_id=need("remote_engine_id", str),
            request_id=need("remote_request_id", str),
            host=need("remote_host", str),
            port=port,
            tp_size=tp_size,
            block_ids=tuple(b for g in groups for b in g),
            incarnation=incarnation,
            readers=readers,
            mode=mode,
            block_size=block_size,
            groups=groups if len(groups) > 1 else (),
        )

    @property
    def num_groups(self) -> int:
        return max(1, len(self.groups))


@dataclass
class LoadSpec:
    """One request to load: the local blocks to fill (empty: a full local
    prefix hit, only release the prefill's lend) and where from; or why it
    cannot be loaded (``error``), so the worker reports it failed."""

    local_block_ids: List[int]
    remote: Optional[RemotePrefill]
    error: Optional[str] = None
    #: The prefill's blocks this load reads, in token order, where its
    #: blocks hold another number of tokens than the decode's; None: the
    #: last ``len(local_block_ids)`` of the remote's, one for one.
    remote_block_ids: Optional[List[int]] = None


@dataclass
class KvpollConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers: loads by request id, and lends by
    request id (block ids, incarnation) of prefills that finished."""

    reqs_to_recv: Dict[str, LoadSpec] = field(default_factory=dict)
    reqs_to_send: Dict[str, Tuple[List[int], int]] = field(default_factory=dict)
