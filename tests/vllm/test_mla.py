"""A model with latent attention (MLA, DeepSeek-V2's: one latent KV per
token, replicated across tensor-parallel ranks rather than split by
head) on real vLLM engines (the CPU build's MLA backend, bfloat16,
blocks of 16): a decode rank reads whole blocks from the prefill ranks
holding the same KV, whatever the two TP sizes, and its tokens are an
aggregated instance's: of the decode's TP size, or, between different
sizes, of the prefill's (bfloat16 sums round by TP size, and the
prompt's KV is the prefill's while the new tokens are the decode's: a
near tie may fall either way; KV that did not arrive whole gives
neither)."""

from __future__ import annotations

import pytest

from harness import free_port
from instance import Instance, killed_prefill_drill, kv_config

N = 5
MAX_TOKENS = 6
DTYPE = "bfloat16"  # the CPU MLA backend's weights


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory) -> str:
    """A random-weight DeepSeek-V2 (vocab 512, hidden 256, 4 heads, latent
    rank 512 and rope 64: the 576-wide latent the CPU kernel takes, 2
    dense layers) written with transformers."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    path = str(tmp_path_factory.mktemp("tiny-mla"))
    cfg = DeepseekV2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=2,  # both layers dense: no experts routed
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(mla_dir):
    """The prompts, and ``{tp: tokens}`` of an aggregated instance of
    that TP size (bfloat16 sums over two ranks round otherwise than over
    one, so a decode is compared with an instance of its own size)."""
    prompts = [[(17 * n + 7 * i) % 500 + 3 for i in range(13 + 21 * n)] for n in range(N)]
    tokens = {}
    for tp in (1, 2):
        agg = Instance(mla_dir, tp=tp, dtype=DTYPE).ready()
        try:
            tokens[tp] = [agg.generate([q], MAX_TOKENS)[0]["token_ids"] for q in prompts]
        finally:
            agg.close()
    return prompts, tokens


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2), (1, 1)])
def test_an_mla_decode_reads_whole_latent_blocks_from_prefill_ranks_of_any_tp_and_gives_the_aggregated_output(
    mla_dir, reference, p_tp, d_tp
):
    prompts, tokens = reference
    p = Instance(mla_dir, kv_config(free_port(), lease_s=60.0, decode_tp_size=d_tp), tp=p_tp, dtype=DTYPE)
    d = Instance(
        mla_dir, kv_config(free_port(), "fail", read_deadline_s=20.0, handshake_timeout_s=5.0), tp=d_tp, dtype=DTYPE
    )
    try:
        p.ready()
        d.ready()
        params = [p.generate([q], 1, [{"do_remote_decode": True}])[0]["kv_transfer_params"] for q in prompts]
        assert all(x["tp_size"] == p_tp and x["kvpoll_readers"] == max(1, d_tp // p_tp) for x in params), params[0]
        # Policy fail: a load that did not happen is an error, not a
        # recompute. One request at a time, as the reference: bfloat16
        # kernels round otherwise in other batches.
        outs = [d.generate([q], MAX_TOKENS, [x])[0] for q, x in zip(prompts, params)]
        assert [o["finish_reason"] for o in outs] == ["length"] * N
        for i, o in enumerate(outs):
            assert o["token_ids"] in (tokens[d_tp][i], tokens[p_tp][i]), (i, o["token_ids"], tokens[d_tp][i], tokens[p_tp][i])
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
def test_a_killed_mla_prefill_gives_recomputed_or_failed_responses_never_other_tokens(mla_dir, reference, p_tp, d_tp):
    prompts, tokens = reference
    p = Instance(mla_dir, kv_config(free_port(), lease_s=60.0, decode_tp_size=d_tp), tp=p_tp, dtype=DTYPE)
    # Two-rank decodes start their handshakes on a starved host: a longer
    # timeout there.
    fast = dict(read_deadline_s=5.0 * d_tp, handshake_timeout_s=2.0 * d_tp)
    d_fail = Instance(mla_dir, kv_config(free_port(), "fail", **fast), tp=d_tp, dtype=DTYPE)
    d_rec = Instance(mla_dir, kv_config(free_port(), "recompute", **fast), tp=d_tp, dtype=DTYPE)
    made = [p, d_fail, d_rec]
    try:
        for i in made:
            i.ready()
        # Two prompts: one request a batch on each decode, as the reference.
        killed_prefill_drill(p, d_fail, d_rec, prompts[:2], tokens[d_tp][:2], MAX_TOKENS)
    finally:
        for i in made:
            i.close()
