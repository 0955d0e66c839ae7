"""``kv_connector_extra_config`` keys, read once by both halves."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

#: How many prefill ranks one decode rank may gather a block from (a
#: prefill of up to 8× the decode's TP size), and how many prefill blocks
#: one decode block may be made of: the engine's ledger holds this many
#: local block ids per request for each block the KV cache holds.
MAX_GATHER = 8


@dataclass(frozen=True)
class KvpollConfig:
    """The connector's settings (``kv_connector_extra_config``)."""

    #: Where this instance's workers answer handshakes: rank r on port + r.
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5700
    #: How long a prefill's lent blocks wait for their decode (seconds):
    #: from the prefill's response through the decode's queueing, its
    #: handshake and its read, so longer than ``handshake_timeout_s +
    #: read_deadline_s`` (a lease that ends first fails the load).
    lease_s: float = 120.0
    #: UCX transports (UCX_TLS), e.g. "tcp"; None lets UCX choose.
    ucx_tls: Optional[str] = None
    #: How long a read may take before its prefill is judged stalled and
    #: the load fails (seconds).
    read_deadline_s: float = 30.0
    #: How long a decode waits for a prefill's handshake (seconds).
    handshake_timeout_s: float = 5.0
    #: The engine's poller: "adaptive" (sleeps when idle) or "busy".
    idle: str = "adaptive"
    #: The decode instances' tensor-parallel size, if larger than this
    #: prefill's: each prefill rank's lend then waits for that many
    #: decode ranks per prefill rank to read it. None: this instance's.
    decode_tp_size: Optional[int] = None
    #: How a prefill's KV reaches its decode: "pull" (the decode reads the
    #: lent blocks) or "push" (the decode lends its blocks to writers and
    #: asks the prefill to write them). The prefill's setting; its
    #: responses tell the decode.
    mode: str = "pull"
    #: Whether peers may write into this instance's KV cache. Only a push
    #: destination needs it (a decode whose prefill is in push mode); off,
    #: a push load fails at once, and where ``ucx_tls`` is ``"tcp"``
    #: alone a peer's write into the cache is refused (docs/design.md
    #: says what guards each transport). For deployments that only pull.
    remote_write: bool = True
    #: A file holding the deployment's secret (at least 16 bytes): the
    #: engine, its metadata and notifications, and the side channel are
    #: then keyed, and a peer without the key is refused and counted
    #: (``auth.py``). None: the secret in ``KVPOLL_AUTH_KEY`` if set, else
    #: no key.
    auth_key_file: Optional[str] = None

    def for_data_parallel_rank(self, dp_index: int, tp_size: int) -> "KvpollConfig":
        """The settings of data-parallel rank ``dp_index`` of an instance of
        ``tp_size`` tensor-parallel ranks: its ranks answer on ports of
        their own, ``side_channel_port + dp_index * tp_size + tp_rank``, so
        several DP ranks share a host (vLLM gives each its own engine id)."""
        if dp_index <= 0:
            return self
        port = self.side_channel_port + dp_index * tp_size
        if port + tp_size > 65536:
            raise ValueError(
                f"side_channel_port {self.side_channel_port}: data-parallel rank {dp_index} of {tp_size} "
                f"ranks would answer on {port}..{port + tp_size - 1}, past 65535"
            )
        return replace(self, side_channel_port=port)

    def lease_warning(self) -> Optional[str]:
        """Why ``lease_s`` is too short for a load that runs its handshake
        and its read to their bounds; None if it is long enough."""
        bound = self.handshake_timeout_s + self.read_deadline_s
        if self.lease_s > bound:
            return None
        return (
            f"lease_s {self.lease_s:g} is not longer than handshake_timeout_s + read_deadline_s ({bound:g}): "
            "a decode whose handshake and read run to their bounds finds the lend ended and its load fails; "
            f"set lease_s above {bound:g} (with the time requests queue at the decode)"
        )

    def readers_per_lend(self, tp_size: int) -> int:
        """Decode ranks that read each lend of a prefill of ``tp_size``."""
        return max(1, (self.decode_tp_size or tp_size) // tp_size)

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]]) -> "KvpollConfig":
        extra = dict(extra or {})
        known = cls.__dataclass_fields__
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(known)}")
        cfg = cls(**extra)
        if not 0 < cfg.side_channel_port < 65536:
            raise ValueError(f"side_channel_port out of range: {cfg.side_channel_port}")
        if min(cfg.lease_s, cfg.handshake_timeout_s, cfg.read_deadline_s) <= 0:
            raise ValueError("lease_s, read_deadline_s and handshake_timeout_s must be positive")
        if cfg.decode_tp_size is not None and (
            not isinstance(cfg.decode_tp_size, int) or isinstance(cfg.decode_tp_size, bool) or cfg.decode_tp_size <= 0
        ):
            raise ValueError(f"decode_tp_size must be a positive int, not {cfg.decode_tp_size!r}")
        if cfg.mode not in ("pull", "push"):
            raise ValueError(f"mode must be 'pull' or 'push', not {cfg.mode!r}")
        if not isinstance(cfg.remote_write, bool):
            raise ValueError(f"remote_write must be true or false, not {cfg.remote_write!r}")
        if cfg.auth_key_file is not None and not isinstance(cfg.auth_key_file, str):
            raise ValueError(f"auth_key_file must be a path, not {cfg.auth_key_file!r}")
        if cfg.idle not in ("adaptive", "busy"):
            raise ValueError(f"idle must be 'adaptive' or 'busy', not {cfg.idle!r}")
        return cfg
