"""A prefill and a decode vLLM Scheduler stepping, each with its
KvpollConnector worker in its own process moving real CPU KV tensors over
kvpoll (UCX, tcp on 127.0.0.1)."""

from __future__ import annotations

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
            remote = params[rid[2:]]["remote_block_ids"]
            assert len(local[rid]) == len(remote)
            assert dw.dump(local[rid]) == pw.dump(remote), f"{rid}: decode KV differs from prefill KV"
            compared.append(rid)

    tokens = run_until_empty(p, pw, d, dw, on_recv)
    assert sorted(compared) == sorted(f"d-{r}" for r in prompts)
    assert all(len(tokens[f"d-{r}"]) == 3 for r in prompts), tokens
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
