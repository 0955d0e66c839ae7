"""A hybrid model (sliding-window and full-attention layers alternating,
as Gemma 2/3 and gpt-oss lay them out): the tiny Llama with
``layer_types`` and a 32-token window, which vLLM's Llama honours per
layer. kvpoll does not declare hybrid support, so vLLM turns its hybrid
KV cache manager off: one KV cache group, the window layers' KV kept
whole and moved whole. Prompts longer than the window decode through
kvpoll as the aggregated instance does."""

from __future__ import annotations

import json
import os

import pytest

from harness import free_port, tiny_model
from instance import Instance, kv_config

N = 4
MAX_TOKENS = 8
WINDOW = 32


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> str:
    path = tiny_model(str(tmp_path_factory.mktemp("tiny-hybrid")))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def test_a_sliding_window_and_full_attention_model_decodes_through_kvpoll_as_aggregated(hybrid_dir, model_dir):
    prompts = [[(13 * n + 5 * i) % 500 + 3 for i in range(3 * WINDOW + 17 * n)] for n in range(N)]
    agg = Instance(hybrid_dir)
    # The same weights without the window.
    full = Instance(model_dir)
    p = Instance(hybrid_dir, kv_config(free_port(), lease_s=60.0))
    d = Instance(hybrid_dir, kv_config(free_port(), "fail", read_deadline_s=20.0, handshake_timeout_s=5.0))
    made = [agg, full, p, d]
    try:
        for i in made:
            i.ready()
        want = [o["token_ids"] for o in agg.generate(prompts, MAX_TOKENS)]
        # The window changes the answer: vLLM runs the window layers as such.
        assert [o["token_ids"] for o in full.generate(prompts, MAX_TOKENS)] != want
        params = [o["kv_transfer_params"] for o in p.generate(prompts, 1, [{"do_remote_decode": True}] * N)]
        assert all(len(x["remote_block_ids"]) == 1 for x in params), "one KV cache group"
        outs = d.generate(prompts, MAX_TOKENS, params)
        assert [o["finish_reason"] for o in outs] == ["length"] * N
        assert [o["token_ids"] for o in outs] == want
    finally:
        for i in made:
            i.close()
