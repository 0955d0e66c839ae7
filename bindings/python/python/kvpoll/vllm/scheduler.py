"""The scheduler half: which requests load from a remote prefill, which
lend their blocks to a remote decode, and the ``kv_transfer_params`` that
tie the two."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from kvpoll import draw_incarnation

from .config import MAX_GATHER, KvpollConfig
from .log import get_logger
from .metadata import (
    INCARNATION_KEY,
    MODE_KEY,
    READERS_KEY,
    KvpollConnectorMetadata,
    LoadSpec,
    RemotePrefill,
    TransferParamsError,
)

logger = get_logger(__name__)

#: The block vLLM's block pool keeps for positions a request holds no
#: block at (a sliding window's freed blocks); never lent or loaded.
NULL_BLOCK = 0


def block_sizes_refusal(remote: int, local: int, same_tp: bool, mode: str, cache_dtype: str = "auto") -> Optional[str]:
    """Why blocks of ``remote`` tokens cannot be loaded into blocks of
    ``local``; None where the decode reorders them (``layout.py``)."""
    if max(remote, local) % min(remote, local):
        return "one must divide the other"
    if max(remote, local) // min(remote, local) > MAX_GATHER:
        return f"one may be at most {MAX_GATHER} times the other"
    if not same_tp:
        return "different block sizes are loaded between equal tensor-parallel sizes only"
    if mode != "pull":
        return "different block sizes are loaded in pull mode only"
    if cache_dtype != "auto":
        return f"different block sizes are reordered in unquantized KV caches only, not {cache_dtype}"
    try:
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
    except Exception:  # noqa: BLE001 - no platform: nothing to reorder with
        cpu = False
    if not cpu:
        return "different block sizes are reordered on vLLM's CPU backend only"
    return None


if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class KvpollScheduler:
    """Scheduler-side state: this step's loads and lends, and the decode
    requests matched for a remote load whose parameters were refused (the
    engine reports each request once; the workers map reports to ids).

    A decode request with ``do_remote_prefill`` is matched (its
    ``kv_transfer_params`` checked here, before vLLM allocates for it),
    then allocated (its load goes to the workers), or finished before
    that (a release goes to the workers, never a load). Parameters that
    cannot be loaded are refused at the match: no tokens are claimed, so
    vLLM computes the prompt itself instead of failing the request."""

    def __init__(
        self,
        engine_id: str,
        tp_size: int,
        config: KvpollConfig,
        block_size: int = 0,
        kv_replicated: bool = False,
        cache_dtype: str = "auto",
        windows: Optional[List[Optional[int]]] = None,
    ) -> None:
        self.engine_id = engine_id
        #: Per KV cache group, its sliding window in tokens (None: full
        #: attention); one full-attention group unless vLLM's hybrid KV
        #: cache manager made several (``kv_cache_groups``).
        self.windows: List[Optional[int]] = list(windows) if windows else [None]
        #: Loads go group by group (``_group_load``): several groups, or a
        #: sliding window's.
        self.grouped = len(self.windows) > 1 or any(w is not None for w in self.windows)
        #: Every rank holds the whole KV (MLA): a decode rank reads whole
        #: blocks from prefill ranks, whatever the two TP sizes.
        self.kv_replicated = kv_replicated
        #: vLLM's ``cache_dtype``: "auto" keeps the model's dtype.
        self.cache_dtype = str(cache_dtype)
        self.tp_size = tp_size
        self.config = config
        #: Tokens a block holds (vLLM's ``block_size``); 0 if unknown.
        self.block_size = block_size or 0
        self._recv: Dict[str, LoadSpec] = {}
        self._send: Dict[str, Tuple[List[int], int]] = {}
        # Matched requests refused: why, and the remote to release (None
        # when the parameters name none).
        self._refused: Dict[str, Tuple[str, Optional[RemotePrefill]]] = {}

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            refused = self._refused.get(request.request_id)
            if refused is None:
                check = self._load_spec(params, [])
                if check.error is not None:
                    logger.warning(
                        "kvpoll: %s will be computed here, its KV not loaded: %s", request.request_id, check.error
                    )
                    refused = self._refused[request.request_id] = (check.error, check.remote)
            if refused is not None:
                return 0, False
            end = self._loaded_end(params, len(request.prompt_token_ids or ()))
            why = self._prefix_refusal(end, num_computed_tokens)
            if why is not None:
                # The rest of the prompt (under a window) is computed here.
                logger.info("kvpoll: %s will be computed here, its KV not loaded: %s", request.request_id, why)
                self._refused[request.request_id] = (why, check.remote)
                return 0, False
            remote_size = self._remote_block_size(params)
            if remote_size and num_computed_tokens % remote_size and end > num_computed_tokens:
                # Prefill blocks are reordered whole: this local prefix
                # ends inside one.
                why = f"a local prefix of {num_computed_tokens} tokens ends inside a prefill block of {remote_size}"
                logger.warning("kvpoll: %s will be computed here, its KV not loaded: %s", request.request_id, why)
                self._refused[request.request_id] = (why, check.remote)
                return 0, False
            count = end - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def _remote_block_size(self, params: Dict[str, Any]) -> int:
        """The prefill's tokens per block where they differ from this
        instance's (and both are known), else 0."""
        size = params.get("remote_block_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 0 and self.block_size and size != self.block_size:
            return size
        return 0

    def _loaded_end(self, params: Dict[str, Any], prompt: int) -> int:
        """Where the tokens a load fills end: the prompt's end, or, for
        prefill blocks larger than this instance's, the end of the
        prompt's last whole prefill block (a part of one cannot be
        reordered: its tokens are computed here)."""
        remote = self._remote_block_size(params)
        if remote > self.block_size:
            return prompt // remote * remote
        return prompt

    def kept(self, group: int, blocks: List[int]) -> List[int]:
        """The blocks of ``group`` a decode needs, in token order: a
        sliding-window group's last ``cdiv(window, block_size) + 1`` (the
        window's, wherever it starts in a block), every other group's all;
        never the null block vLLM puts where it freed a block."""
        window = self.windows[group] if group < len(self.windows) else None
        if window is not None and self.block_size:
            blocks = blocks[max(0, len(blocks) - (-(-window // self.block_size) + 1)) :]
        return [b for b in blocks if b != NULL_BLOCK]

    def _lend_order(self, n: int) -> List[int]:
        """The order a prefill lends its groups' blocks in: full-attention
        groups first, then sliding-window ones. A lend confirms a read of
        a run of its blocks in the order lent (or all of them); a decode
        that holds a prefix of the prompt itself reads a suffix of each
        full-attention group and every window block, which this order
        makes one run (``_prefix_refusal`` says when it would not)."""
        windows = [self.windows[g] if g < len(self.windows) else None for g in range(n)]
        return [g for g in range(n) if windows[g] is None] + [g for g in range(n) if windows[g] is not None]

    def _prefix_refusal(self, prompt: int, computed: int) -> Optional[str]:
        """Why a load of several KV cache groups cannot follow a local
        prefix of ``computed`` tokens, where it cannot: the blocks it would
        read are then no run of the prefill's lend (``_lend_order``)."""
        if not computed or not self.grouped:
            return None
        if sum(w is None for w in self.windows) > 1:
            return "a local prefix with more than one full-attention KV cache group"
        bs = self.block_size or 1
        keep = max((-(-w // bs) + 1 for w in self.windows if w is not None), default=0)
        if computed // bs > -(-prompt // bs) - keep:
            return f"a local prefix of {computed} tokens reaches into the sliding window of the prompt's last {keep} blocks"
        return None

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        # One load (or release) per request, also if it is scheduled again.
        params["do_remote_prefill"] = False
        refused = self._refused.pop(request.request_id, None)
        if refused is not None:
            self._release(request.request_id, refused[1])
            return
        if self.grouped:
            self._recv[request.request_id] = self._group_load(params, blocks, num_external_tokens)
            return
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        spec = self._load_spec(params, local)
        remote_size = self._remote_block_size(params)
        if local and remote_size and spec.error is None and spec.remote is not None:
            end = self._loaded_end(params, len(request.prompt_token_ids or ()))
            start = end - num_external_tokens
            first, last = start // remote_size, -(-end // remote_size)
            if last > len(spec.remote.block_ids):
                spec.error = f"tokens {start}..{end} need {last} prefill blocks, the prefill lent {len(spec.remote.block_ids)}"
            else:
                spec.remote_block_ids = list(spec.remote.block_ids[first:last])
        self._recv[request.request_id] = spec

    def _group_load(self, params: Dict[str, Any], blocks: "KVCacheBlocks", num_external_tokens: int) -> LoadSpec:
        """The load of a request whose KV cache has several groups: each
        group's new blocks (a sliding-window group's in the window only)
        paired with the last as many of the prefill's blocks of that group,
        all read as one list: block ids are the engine's, one pool for
        every group, and each of the KV cache's tensors holds, at a block,
        the layer of the group that owns it."""
        local_groups = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else [[] for _ in self.windows]
        check = self._load_spec(params, [])
        if check.error is not None or check.remote is None:
            return check
        remote = check.remote
        local: List[int] = []
        paired: List[int] = []
        for g, (mine, theirs) in enumerate(zip(local_groups, remote.groups or (remote.block_ids,))):
            mine = self.kept(g, list(mine))
            if len(mine) > len(theirs):
                why = f"KV cache group {g}: {len(mine)} blocks to load, the prefill lent {len(theirs)}"
                return LoadSpec(local + mine, remote, why)
            local += mine
            paired += theirs[len(theirs) - len(mine) :]
        # Read one for one: the worker reads the last len(local) of the
        # remote's blocks.
        return LoadSpec(local, dataclasses.replace(remote, block_ids=tuple(paired)))

    def _release(self, req_id: str, remote: Optional[RemotePrefill]) -> None:
        """Tells the workers to release the prefill's blocks without
        reading them (nothing if the parameters named no prefill)."""
        if remote is not None:
            self._recv[req_id] = LoadSpec([], remote)

    def _load_spec(self, params: Dict[str, Any], local: List[int]) -> LoadSpec:
        try:
            remote = RemotePrefill.from_params(params)
        except TransferParamsError as e:
            return LoadSpec(local, None, str(e))
        p_tp, d_tp = remote.tp_size, self.tp_size
        if remote.num_groups != len(self.windows):
            return LoadSpec(
                local,
                remote,
                f"the prefill names {remote.num_groups} KV cache groups, this instance has {len(self.windows)} "
                "(vLLM's hybrid KV cache manager on one side, off on the other?)",
            )
        if self.grouped and remote.block_size and self.block_size and remote.block_size != self.block_size:
            return LoadSpec(local, remote, "different block sizes are loaded into full-attention KV caches only")
        if self.grouped and remote.mode != "pull":
            return LoadSpec(local, remote, "sliding-window or several KV cache groups load in pull mode only")
        if remote.block_size and self.block_size and remote.block_size != self.block_size:
            # Found here rather than at the handshake (a failed load, an
            # error under policy "fail"): the prompt is computed here.
            why = block_sizes_refusal(remote.block_size, self.block_size, p_tp == d_tp, remote.mode, self.cache_dtype)
            if why is not None:
                return LoadSpec(
                    local, remote, f"prefill blocks of {remote.block_size} tokens, decode blocks of {self.block_size}: {why}"
                )
        if max(p_tp, d_tp) % min(p_tp, d_tp):
            return LoadSpec(local, remote, f"prefill tp_size {p_tp}, decode tp_size {d_tp}: one must divide the other")
        if self.kv_replicated and p_tp != d_tp and remote.mode != "pull":
            return LoadSpec(
                local, remote, f"prefill tp_size {p_tp}, decode tp_size {d_tp}: KV replicated across ranks (MLA) loads in pull mode only"
            )
        readers = max(1, d_tp // p_tp)
        if remote.readers != readers:
            # Fewer: the prefill would free its blocks after the first
            # decode rank's read, under the others' reads.
            return LoadSpec(
                local,
                remote,
                f"the prefill lends each rank's blocks to {remote.readers} decode ranks, {readers} read them here: "
                f"set decode_tp_size {d_tp} in the prefill's kv_connector_extra_config",
            )
        if len(local) > len(remote.block_ids) and not (remote.block_size and remote.block_size != self.block_size):
            return LoadSpec(local, remote, f"{len(local)} blocks to load, the prefill lent {len(remote.block_ids)}")
        return LoadSpec(local, remote)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvpollConnectorMetadata:
        meta = KvpollConnectorMetadata(reqs_to_recv=self._recv, reqs_to_send=self._send)
        self._recv, self._send = {}, {}
        return meta

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: "Request", block_ids: Tuple[List[int], ...]
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """A finished request: a decode's not loaded yet releases its
        prefill's lend; a prefill's lends its blocks, every KV cache
        group's (a sliding-window group's in the window only: vLLM freed
        the others already), and answers with them per group."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Finished (aborted) before it was scheduled: release the
            # prefill's lend without reading, so its blocks free now. vLLM
            # forgets the request now: the workers never report a release.
            params["do_remote_prefill"] = False
            refused = self._refused.pop(request.request_id, None)
            spec = self._load_spec(params, [])
            self._release(request.request_id, refused[1] if refused else spec.remote)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: nobody will read it
        groups = [self.kept(g, list(ids)) for g, ids in enumerate(block_ids)]
        blocks = [b for g in self._lend_order(len(groups)) for b in groups[g]]
        delay = bool(blocks)
        inc = draw_incarnation()
        if delay:
            # Freed when the decode read them (finished_sending) or the
            # lease ended, never earlier.
            self._send[request.request_id] = (blocks, inc)
        answer = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            # One list per KV cache group, as NixlConnector's routers
            # forward them.
            "remote_block_ids": groups,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.config.side_channel_host,
            "remote_port": self.config.side_channel_port,
            "tp_size": self.tp_size,
            INCARNATION_KEY: f"{inc:x}",
            READERS_KEY: self.config.readers_per_lend(self.tp_size),
            MODE_KEY: self.config.mode,
        }
        if self.block_size:
            answer["remote_block_size"] = self.block_size
        return delay, answer
