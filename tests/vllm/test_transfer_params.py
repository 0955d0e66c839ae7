"""The ``kv_transfer_params`` between the scheduler halves, in the shape
the routers written for vLLM's NixlConnector forward: the prefill names
its blocks per KV cache group (``[[...]]``) beside NIXL's other keys and
kvpoll's own; the decode loads them in that shape or kvpoll's earlier
flat list, and refuses any other at the match (no tokens claimed, the
prompt computed locally), never with anything but a
``TransferParamsError``. vLLM's own ``Scheduler`` runs the decode; no
workers are needed to see what it hands them."""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest

from harness import free_port, request, scheduler, vllm_config

PROMPT = list(range(3, 40))  # 37 tokens: 3 blocks of 16
#: What routers for NixlConnector send a prefill (vllm-router's
#: ``--vllm-pd-disaggregation``): NIXL's keys present, null.
ROUTER_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def finished_prefill(model_dir: str, blocks: List[int], params: Dict[str, Any]) -> Dict[str, Any]:
    """The params a prefill's scheduler half answers for a request that
    finished holding ``blocks``, as a router forwards them (through JSON)."""
    from vllm.v1.request import RequestStatus

    p = scheduler(vllm_config(model_dir, free_port()))
    r = request("p-0", PROMPT, 1, dict(params))
    # A prefill request claims nothing from a remote.
    assert p.connector.get_num_new_matched_tokens(r, 0) == (0, False)
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, out = p.connector.request_finished(r, blocks)
    assert delay, "the prefill frees its blocks before the decode read them"
    assert out is not None
    return json.loads(json.dumps(out))


def test_a_finished_prefill_names_its_blocks_per_kv_cache_group_beside_nixls_and_kvpolls_keys(model_dir):
    params = finished_prefill(model_dir, [4, 5, 6], {"do_remote_decode": True})
    assert params["remote_block_ids"] == [[4, 5, 6]]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_request_id"] == "p-0"
    assert isinstance(params["remote_engine_id"], str) and params["remote_engine_id"]
    assert params["remote_host"] == "127.0.0.1" and isinstance(params["remote_port"], int)
    assert params["tp_size"] == 1
    assert int(params["kvpoll_incarnation"], 16) > 0
    assert params["kvpoll_readers"] == 1 and params["kvpoll_mode"] == "pull"


def test_a_prefill_request_with_nixls_keys_null_as_routers_send_it_lends_its_blocks(model_dir):
    params = finished_prefill(model_dir, [7, 8, 9], ROUTER_PREFILL_PARAMS)
    assert params["remote_block_ids"] == [[7, 8, 9]]
    assert params["do_remote_prefill"] is True


def loaded(model_dir: str, params: Dict[str, Any]) -> Any:
    """The decode's first step for a request with ``params``: the load
    spec its scheduler half hands the workers, after checking the claim."""
    d = scheduler(vllm_config(model_dir, free_port()))
    r = request("d-0", PROMPT, 3, params)
    assert d.connector.get_num_new_matched_tokens(r, 0) == (len(PROMPT), True)
    d.add_request(r)
    so = d.schedule()
    return so.kv_connector_metadata.reqs_to_recv["d-0"]


@pytest.mark.parametrize("shape", ["per_group", "flat"])
def test_the_decode_loads_the_prefills_blocks_named_per_kv_cache_group_or_flat(model_dir, shape):
    params = finished_prefill(model_dir, [4, 5, 6], {"do_remote_decode": True})
    if shape == "flat":  # kvpoll's params before they named groups
        params["remote_block_ids"] = params["remote_block_ids"][0]
    spec = loaded(model_dir, params)
    assert spec.error is None, spec.error
    assert spec.remote.block_ids == (4, 5, 6)
    assert len(spec.local_block_ids) == 3


def _params(blocks: Any) -> Dict[str, Any]:
    from kvpoll import draw_incarnation

    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": blocks,
        "remote_engine_id": "engine-x",
        "remote_request_id": "p-0",
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
        "tp_size": 1,
        "kvpoll_incarnation": f"{draw_incarnation():x}",
        "kvpoll_readers": 1,
        "kvpoll_mode": "pull",
    }


@pytest.mark.parametrize(
    "blocks, why",
    [
        ([[1, 2], [2, 3]], "names a block twice"),
        ([[1, 1]], "names a block twice"),
        ([1, [2]], "not a list of block ids"),
        ([[[1]]], "not a list of block ids"),
        ([[1, -2]], "not a list of block ids"),
        ([[1, 2**32]], "not a list of block ids"),
        ([2**40], "not a list of block ids"),
        ([[True]], "not a list of block ids"),
        ([[1.0]], "not a list of block ids"),
        ([[None]], "not a list of block ids"),
        ("1,2", "not a list of block ids"),
        ({"0": [1]}, "not a list of block ids"),
        (None, "not a list of block ids"),
    ],
)
def test_block_ids_in_no_shape_the_decode_knows_are_refused_at_the_match_with_a_typed_error(model_dir, blocks, why):
    from kvpoll.vllm.metadata import RemotePrefill, TransferParamsError

    params = _params(blocks)
    with pytest.raises(TransferParamsError, match=why):
        RemotePrefill.from_params(params)
    d = scheduler(vllm_config(model_dir, free_port()))
    assert d.connector.get_num_new_matched_tokens(request("d-0", PROMPT, 3, params), 0) == (0, False)


@pytest.mark.parametrize(
    "d_tp, p_tp, readers, claimed",
    [
        (1, 1, 1, True),
        (2, 1, 2, True),
        (1, 2, 1, True),
        # Neither size divides the other: no mapping of heads to ranks.
        (2, 3, 1, False),
        # Two decode ranks read each prefill rank's lend, which waits for one.
        (2, 1, 1, False),
    ],
    ids=["same", "decode-larger-told", "prefill-larger", "neither-divides", "readers-too-few"],
)
def test_tp_sizes_the_decode_cannot_map_are_refused_at_the_match(model_dir, d_tp, p_tp, readers, claimed):
    from harness import request, scheduler, vllm_config

    d = scheduler(vllm_config(model_dir, free_port(), tp=d_tp))
    params = {**_params([[4, 5, 6]]), "tp_size": p_tp, "kvpoll_readers": readers}
    got = d.connector.get_num_new_matched_tokens(request("d-0", PROMPT, 3, params), 0)
    assert got == ((len(PROMPT), True) if claimed else (0, False))


@pytest.mark.parametrize("blocks", [[[1, 2], [3, 4]], [[1], [2], [3]]])
def test_params_of_several_kv_cache_groups_are_refused_at_the_match_of_a_decode_of_one(model_dir, blocks):
    # A prefill with vLLM's hybrid KV cache manager on, a decode with it
    # off (or another model): nothing claimed, the prompt computed here.
    from kvpoll.vllm.metadata import RemotePrefill

    params = _params(blocks)
    assert RemotePrefill.from_params(params).num_groups == len(blocks)
    d = scheduler(vllm_config(model_dir, free_port()))
    assert d.connector.get_num_new_matched_tokens(request("d-0", PROMPT, 3, params), 0) == (0, False)


class _Blocks:
    """What vLLM's scheduler hands ``update_state_after_alloc``: a
    request's blocks per KV cache group."""

    def __init__(self, groups: List[List[int]]) -> None:
        self.groups = groups

    def get_unhashed_block_ids_all_groups(self) -> List[List[int]]:
        return self.groups


def _hybrid(port: int) -> Any:
    """The scheduler half of an instance with a sliding-window group (32
    tokens) and a full-attention group, blocks of 16."""
    from kvpoll.vllm.config import KvpollConfig
    from kvpoll.vllm.scheduler import KvpollScheduler

    return KvpollScheduler("engine-h", 1, KvpollConfig.from_extra({"side_channel_port": port}), 16, windows=[32, None])


def test_a_hybrid_prefill_lends_every_groups_blocks_the_window_groups_in_the_window_only():
    from vllm.v1.request import RequestStatus

    p = _hybrid(free_port())
    prompt = list(range(3, 99))  # 96 tokens: 6 blocks
    r = request("p-0", prompt, 1, {"do_remote_decode": True})
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    # vLLM's lists: the window group's freed blocks are the null block.
    delay, out = p.request_finished_all_groups(r, ([0, 0, 0, 0, 21, 22], [11, 12, 13, 14, 15, 16]))
    assert delay and out is not None
    assert out["remote_block_ids"] == [[21, 22], [11, 12, 13, 14, 15, 16]]
    # Lent full-attention group first: a decode holding a prefix reads a
    # suffix of it and every window block, one run of the lend.
    meta = p.build_connector_meta(None)
    assert meta.reqs_to_send["p-0"][0] == [11, 12, 13, 14, 15, 16, 21, 22]


def test_a_hybrid_decode_pairs_each_groups_blocks_with_the_prefills_of_that_group():
    d = _hybrid(free_port())
    prompt = list(range(3, 99))
    params = _params([[21, 22], [11, 12, 13, 14, 15, 16]])
    r = request("d-0", prompt, 3, dict(params))
    assert d.get_num_new_matched_tokens(r, 0) == (len(prompt), True)
    d.update_state_after_alloc(r, _Blocks([[31, 32], [41, 42, 43, 44, 45, 46]]), len(prompt))
    spec = d.build_connector_meta(None).reqs_to_recv["d-0"]
    assert spec.error is None, spec.error
    assert spec.local_block_ids == [31, 32, 41, 42, 43, 44, 45, 46]
    # The worker reads the last len(local) of these, one for one.
    assert spec.remote.block_ids == (21, 22, 11, 12, 13, 14, 15, 16)
    # A window group needing more blocks than the prefill kept fails the
    # load with why, rather than reading another group's blocks.
    r = request("d-1", prompt, 3, dict(params))
    assert d.get_num_new_matched_tokens(r, 0) == (len(prompt), True)
    d.update_state_after_alloc(r, _Blocks([[31, 32, 33], [41, 42, 43, 44, 45, 46]]), len(prompt))
    spec = d.build_connector_meta(None).reqs_to_recv["d-1"]
    assert spec.error is not None and "group 0" in spec.error


@pytest.mark.parametrize("computed, claimed", [(0, 96), (16, 80), (48, 48), (64, 0), (80, 0)])
def test_a_hybrid_decode_with_a_local_prefix_loads_the_rest_unless_the_prefix_reaches_into_the_window(
    computed, claimed
):
    # 96 tokens in blocks of 16, a 32-token window: the last 3 blocks hold
    # the window's. A prefix ending before them leaves a suffix of the full
    # group and every window block to read (one run of the lend); one
    # reaching into them would leave part of each, which the lend does not
    # confirm: the rest, under a window, is computed here.
    d = _hybrid(free_port())
    prompt = list(range(3, 99))
    r = request("d-0", prompt, 3, _params([[21, 22], [11, 12, 13, 14, 15, 16]]))
    assert d.get_num_new_matched_tokens(r, computed) == (claimed, claimed > 0)


def test_kv_cache_groups_name_their_windows_and_ones_kvpoll_cannot_move_refuse_at_start_up():
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from kvpoll.vllm import kv_block_tokens, kv_cache_windows

    def config(*specs):
        groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
        return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)

    attn = dict(num_kv_heads=2, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=32, sliding_window=32, **attn)
    full = FullAttentionSpec(block_size=32, **attn)
    hybrid = config(window, full)
    # vLLM may have chosen other blocks than the configured 16.
    assert kv_block_tokens(hybrid, 16) == 32
    assert kv_cache_windows(hybrid, 32) == [32, None]
    assert kv_cache_windows(config(full), 32) == [None]
    with pytest.raises(ValueError, match="MambaSpec"):
        kv_cache_windows(config(full, MambaSpec(block_size=32, shapes=((4,),), dtypes=(torch.float32,))), 32)
    with pytest.raises(ValueError, match="block size"):
        kv_cache_windows(config(full, SlidingWindowSpec(block_size=16, sliding_window=32, **attn)), 32)
