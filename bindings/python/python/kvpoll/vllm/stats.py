"""The connector's transfer statistics in vLLM's shapes: ``KvpollStats``
(a ``KVConnectorStats``, aggregated over the workers and logged by vLLM's
stats logger) and ``KvpollPromMetrics`` (the Prometheus metrics ``vllm
serve`` shows on ``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

#: Load durations, seconds.
DURATION_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


@dataclass
class KvpollStats(KVConnectorStats):
    """Loads finished and failed, bytes read, load durations and peers
    refused as unauthenticated (side-channel requests, engine metadata and
    notification messages without the deployment's key, or replayed) over
    one logging interval, aggregated over the workers."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"num_transfers": 0, "num_failed": 0, "bytes": 0, "durations_s": [], "num_unauthenticated": 0}

    def aggregate(self, other: KVConnectorStats) -> "KvpollStats":
        for key in ("num_transfers", "num_failed", "bytes", "num_unauthenticated"):
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        self.data["durations_s"] = list(self.data.get("durations_s", [])) + list(other.data.get("durations_s", []))
        return self

    def reduce(self) -> Dict[str, int | float]:
        d = self.data.get("durations_s") or []
        return {
            "Num successful transfers": self.data.get("num_transfers", 0),
            "Num failed transfers": self.data.get("num_failed", 0),
            "Bytes transferred": self.data.get("bytes", 0),
            "Avg xfer time (ms)": round(1000 * sum(d) / len(d), 3) if d else 0,
            "Num unauthenticated peers": self.data.get("num_unauthenticated", 0),
        }

    def is_empty(self) -> bool:
        return not (
            self.data.get("num_transfers") or self.data.get("num_failed") or self.data.get("num_unauthenticated")
        )


class KvpollPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvpoll_*`` counters and a duration histogram, one child per
    engine, fed with each aggregated ``KvpollStats`` the scheduler sends."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Dict[type, type],
        labelnames: List[str],
        per_engine_labelvalues: Dict[int, List[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str) -> Dict[int, Any]:
            return create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames), per_engine_labelvalues
            )

        self.transfers = counter("vllm:kvpoll_num_transfers", "KV loads kvpoll finished whole.")
        self.failed = counter(
            "vllm:kvpoll_num_failed_transfers",
            "KV loads that failed (handshake, refused, stalled or lost prefill); recomputed or failed per policy.",
        )
        self.bytes = counter("vllm:kvpoll_bytes_transferred", "Bytes of KV loads kvpoll finished.")
        self.unauthenticated = counter(
            "vllm:kvpoll_num_unauthenticated_peers",
            "Side-channel requests, engine metadata and notification messages refused as unauthenticated "
            "(no key, another key, or replayed).",
        )
        self.durations = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:kvpoll_xfer_time_seconds",
                documentation="Duration of each finished KV load, from its submission to its report.",
                buckets=DURATION_BUCKETS,
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data or {}
        for metric, key in (
            (self.transfers, "num_transfers"),
            (self.failed, "num_failed"),
            (self.bytes, "bytes"),
            (self.unauthenticated, "num_unauthenticated"),
        ):
            n = data.get(key, 0)
            if isinstance(n, (int, float)) and n > 0:
                metric[engine_idx].inc(n)
        for d in data.get("durations_s") or ():
            self.durations[engine_idx].observe(d)
