"""A prompt of 32 768 tokens (1 024 blocks of 32, twice what one
request could once name) through a prefill and a decode instance of real
vLLM with KvpollConnector: its KV moves in one load and the decode's
tokens are the aggregated instance's."""

from __future__ import annotations

import pytest

from harness import free_port, tiny_model
from instance import Instance, kv_config

TOKENS = 32 * 1024
MAX_MODEL_LEN = TOKENS + 64
BLOCK = 32
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(str(tmp_path_factory.mktemp("tiny-llama-long")), max_positions=MAX_MODEL_LEN)


def test_a_32k_token_prompt_transfers_in_one_load_and_decodes_as_the_aggregated_instance(long_model):
    prompt = [(7 * i + i // 97) % 500 + 3 for i in range(TOKENS)]
    agg = Instance(long_model, max_model_len=MAX_MODEL_LEN, block_size=BLOCK).ready()
    try:
        (ref,) = agg.generate([prompt], MAX_TOKENS, timeout=900)
    finally:
        agg.close()
    p = Instance(long_model, kv_config(free_port(), lease_s=600.0), max_model_len=MAX_MODEL_LEN, block_size=BLOCK)
    d = Instance(
        long_model, kv_config(free_port(), "fail", read_deadline_s=100.0), max_model_len=MAX_MODEL_LEN, block_size=BLOCK
    )
    try:
        p.ready()
        d.ready()
        (pre,) = p.generate([prompt], 1, [{"do_remote_decode": True}], timeout=900)
        params = pre["kv_transfer_params"]
        assert params and len(params["remote_block_ids"][0]) == TOKENS // BLOCK, params and params["remote_block_ids"]
        # Policy fail: a load that did not happen is an error, so the
        # aggregated tokens mean the whole prompt's KV came over kvpoll.
        (out,) = d.generate([prompt], MAX_TOKENS, [params], timeout=900)
        assert out["finish_reason"] == "length", out
        assert out["token_ids"] == ref["token_ids"]
    finally:
        p.close()
        d.close()
