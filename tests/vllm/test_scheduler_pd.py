"""A prefill and a decode vLLM Scheduler stepping, each with its
KvpollConnector worker in its own process moving real CPU KV tensors over
kvpoll (UCX, tcp on 127.0.0.1)."""

from __future__ import annotations

import time
from typing import Dict, List

import pytest

from harness import (
    Worker,
    assert_scheduler_empty,
    decode_requests,
    free_port,
    prefill_all,
    run_until_empty,
    scheduler,
    step,
    vllm_config,
)


@pytest.fixture
def pd(model_dir: str):
    """(prefill scheduler, its worker, decode scheduler, its worker)."""
    made: List[Worker] = []

    def make(policy: str = "recompute", lease_s: float = 30.0, p_port: int = 0):
        p_port = p_port or free_port()
        d_port = free_port()
        p = scheduler(vllm_config(model_dir, p_port, policy, lease_s))
        d = scheduler(vllm_config(model_dir, d_port, policy, lease_s))
        pw, dw = Worker(model_dir, p_port, policy, lease_s), Worker(model_dir, d_port, policy, lease_s)
        made.extend([pw, dw])
        return p, pw, d, dw

    yield make
    for w in made:
        w.close()


def test_decode_kv_equals_prefill_kv_byte_for_byte_and_both_schedulers_end_empty(pd):
    p, pw, d, dw = pd()
    prompts = {f"r{n}": [(7 * n + i) % 500 + 3 for i in range(17 + 13 * n)] for n in range(6)}
    params = prefill_all(p, pw, prompts)
    # The prefill holds every finished request's blocks for its decode.
    assert set(p.requests) == set(prompts)
    decode_requests(d, params, prompts)
    local: Dict[str, List[int]] = {}
    compared: List[str] = []

    def on_recv(so, kv_out):
        for rid, spec in so.kv_connector_metadata.reqs_to_recv.items():
            local[rid] = spec.local_block_ids
        for rid in kv_out.finished_recving or ():
            remote = params[rid[2:]]["remote_block_ids"][0]
            assert len(local[rid]) == len(remote)
            assert dw.dump(local[rid]) == pw.dump(remote), f"{rid}: decode KV differs from prefill KV"
            compared.append(rid)

    tokens = run_until_empty(p, pw, d, dw, on_recv)
    assert sorted(compared) == sorted(f"d-{r}" for r in prompts)
    assert all(len(tokens[f"d-{r}"]) == 3 for r in prompts), tokens
    assert_scheduler_empty(p)
    assert_scheduler_empty(d)


def test_a_prefill_whose_next_step_comes_late_is_still_read_and_the_load_finishes(pd):
    # The prefill's response leaves when its request finishes; its worker
    # lends the blocks at its next step, which may come seconds later (a
    # long batch, an engine stalled on its workers). The decode's read,
    # its data landed, waits for that lend as long as a read may take
    # (read_deadline_s), not a fixed few seconds.
    p, pw, d, dw = pd("fail", lease_s=60.0)
    prompts = {"late": [(5 * i) % 500 + 3 for i in range(40)]}
    params = prefill_all(p, pw, prompts)
    decode_requests(d, params, prompts)
    end = time.monotonic() + 8.0  # past the engine's default lend grace (5 s)
    recving: List[str] = []
    local: Dict[str, List[int]] = {}
    while time.monotonic() < end:
        so, kv_out, _ = step(d, dw)
        local.update((rid, spec.local_block_ids) for rid, spec in so.kv_connector_metadata.reqs_to_recv.items())
        recving += list(kv_out.finished_recving or ())
        time.sleep(0.05)
    assert recving == [], "the load ended before its prefill lent"

    def on_recv(so, kv_out):
        for rid, spec in so.kv_connector_metadata.reqs_to_recv.items():
            local[rid] = spec.local_block_ids
        for rid in kv_out.finished_recving or ():
            recving.append(rid)
            assert dw.dump(local[rid]) == pw.dump(params["late"]["remote_block_ids"][0])

    tokens = run_until_empty(p, pw, d, dw, on_recv)
    assert recving == ["d-late"]
    # Policy fail: a failed load would have ended the request without tokens.
    assert len(tokens["d-late"]) == 3, tokens
    assert_scheduler_empty(p)
    assert_scheduler_empty(d)


def test_decode_requests_aborted_before_and_while_loading_release_the_prefill_and_end_empty(pd):
    # Lease longer than the test's guard: the prefill's blocks can only
    # come back through the decode's release or its read.
    from vllm.v1.request import RequestStatus

    p, pw, d, dw = pd(lease_s=600.0)
    prompts = {f"a{n}": [(5 * n + i) % 500 + 3 for i in range(40 + 9 * n)] for n in range(4)}
    params = prefill_all(p, pw, prompts)
    decode_requests(d, params, prompts)
    # Two aborted before the decode scheduled them (nothing read: the
    # prefill is told to release), two right after they started loading.
    d.finish_requests(["d-a0", "d-a1"], RequestStatus.FINISHED_ABORTED)
    step(d, dw)
    d.finish_requests(["d-a2", "d-a3"], RequestStatus.FINISHED_ABORTED)
    run_until_empty(p, pw, d, dw)
    assert_scheduler_empty(p)
    assert_scheduler_empty(d)


def test_the_default_lease_outlasts_a_read_started_after_a_handshake_and_run_to_its_deadline():
    # A decode that fetches the prefill's handshake first (up to its
    # timeout) and then reads until its deadline must still find the lend
    # live: a lease that ends first turns a slow read into a failed load.
    from kvpoll.vllm.config import KvpollConfig

    c = KvpollConfig.from_extra({})
    assert c.lease_s > c.handshake_timeout_s + c.read_deadline_s, c


def _params_at(port: int, **over) -> Dict[str, object]:
    """kv_transfer_params of a prefill at ``port`` on this host."""
    from kvpoll import draw_incarnation

    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1, 2, 3],
        "remote_engine_id": f"engine-{port}",
        "remote_request_id": "gone",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "tp_size": 1,
        "kvpoll_incarnation": f"{draw_incarnation():x}",
        "kvpoll_readers": 1,
        "kvpoll_mode": "pull",
        **over,
    }


def test_requests_aborted_while_queued_for_an_unreachable_prefill_leave_the_decode_alive_and_empty(pd):
    # A prefill outage, then clients giving up on requests still queued:
    # their releases cannot be sent (nobody answers the handshake, or the
    # params are refused), and vLLM has already freed them, so nothing of
    # them may come back in finished_recving (vLLM's scheduler asserts on
    # it: the EngineCore dies).
    from harness import request
    from vllm.v1.request import RequestStatus

    _, _, d, dw = pd()
    gone = free_port()  # nothing listens there
    prompt = list(range(3, 40))
    d.add_request(request("q-gone", prompt, 3, _params_at(gone)))
    d.add_request(request("q-refused", prompt, 3, _params_at(gone, kvpoll_readers=4)))
    d.add_request(request("q-malformed", prompt, 3, _params_at(gone, remote_port="x")))
    d.finish_requests(["q-gone", "q-refused", "q-malformed"], RequestStatus.FINISHED_ABORTED)
    end = time.monotonic() + 6.0  # past the handshake's failure (2 s timeout)
    while time.monotonic() < end:
        _, kv_out, _ = step(d, dw)
        assert not kv_out.finished_recving, kv_out
        time.sleep(0.05)
    assert_scheduler_empty(d)


def test_params_the_decode_cannot_load_claim_no_tokens_and_the_prompt_is_computed_here(pd):
    # Refused at the match (before vLLM allocates for a load), the request
    # is computed locally: under the fail policy it still answers, with
    # no load attempted and no error.
    from harness import request
    from vllm.v1.request import RequestStatus

    _, _, d, dw = pd(policy="fail")
    prompt = list(range(3, 40))
    bad = _params_at(free_port(), kvpoll_readers=4)  # 4 readers a lend, 1 rank here
    r = request("q-local", prompt, 3, bad)
    assert d.connector.get_num_new_matched_tokens(r, 0) == (0, False)
    d.add_request(r)
    tokens: List[int] = []
    end = time.monotonic() + 60
    while d.requests and time.monotonic() < end:
        so, kv_out, outs = step(d, dw)
        assert not kv_out.invalid_block_ids, "a load was attempted and failed"
        for o in outs:
            tokens.extend(o.new_token_ids)
        time.sleep(0.005)
    step(d, dw)
    assert len(tokens) == 3, tokens
    assert r.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED), r.status
    assert_scheduler_empty(d)


def test_a_lease_no_longer_than_handshake_plus_read_is_warned_about_and_a_longer_one_is_not():
    from kvpoll.vllm.config import KvpollConfig

    short = KvpollConfig.from_extra({"lease_s": 30.0})  # 5 s + 30 s with the defaults
    assert "handshake_timeout_s + read_deadline_s (35)" in (short.lease_warning() or "")
    assert KvpollConfig.from_extra({"lease_s": 36.0}).lease_warning() is None


def test_two_data_parallel_ranks_on_one_host_answer_on_ports_of_their_own_and_name_them(model_dir):
    # vLLM's DP launcher starts one engine per DP rank with the same
    # kv_connector_extra_config: each rank's workers must bind their own
    # ports (not collide on side_channel_port) and its prefill responses
    # must name them.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from harness import kv_cache_config, vllm_config, worker_connector
    from kvpoll.vllm import KvpollConnector
    from kvpoll.vllm.auth import SideChannelKey, load_secret
    from kvpoll.vllm.side_channel import fetch_handshake

    # The deployment's key, when the suite runs with one (KVPOLL_AUTH_KEY).
    secret = load_secret(None)
    key = SideChannelKey(secret) if secret else None
    base = free_port()
    made = []
    try:
        for dp in (0, 1):
            conn, _ = worker_connector(model_dir, base, dp=dp)
            made.append(conn)
        for dp in (0, 1):
            hs = fetch_handshake("127.0.0.1", base + dp, 0, timeout_s=5, key=key)
            assert hs.engine_id == f"engine-{base}" + (f"_dp{dp}" if dp else ""), hs.engine_id
            sched = KvpollConnector(vllm_config(model_dir, base, dp=dp), KVConnectorRole.SCHEDULER, kv_cache_config())
            assert sched.connector_scheduler.config.side_channel_port == base + dp
    finally:
        for conn in made:
            conn.shutdown()
