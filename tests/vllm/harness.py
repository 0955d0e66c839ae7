"""vLLM's own scheduler driving KvpollConnector: configs for a tiny local
model, requests, and connector workers in their own processes holding
real CPU KV tensors (the CPU backend's layout), stepped over a pipe."""

from __future__ import annotations

import hashlib
import socket
import time
from typing import Any, Dict, List, Optional, Set, Tuple, Union

from kvpoll_remote import Child, messages

BLOCK = 16  # tokens per block
NUM_BLOCKS = 64
LAYERS = 2
KV_HEADS = 2
HEAD = 64
EOS = 2


def tiny_model(path: str, max_positions: int = 1024) -> str:
    """A random-weight Llama (vocab 512, hidden 256, 4 heads, 2 KV heads,
    2 layers, head size 64, ``max_positions`` positions) written to
    ``path`` with transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD,
        num_hidden_layers=LAYERS,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=EOS,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


_HANDED_OUT: Set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to connections of its own."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now that a test binds later, below the kernel's
    ephemeral range: a port bound to 0 comes from that range, and the
    connections the engines open meanwhile (UCX's, the control links')
    take ports from it too, so one could take it before the test binds
    it ("Address already in use"). Not handed out twice in a run."""
    low = _ephemeral_low()
    start, end = (20000, low) if low > 21000 else (low + 29000, 65000)
    seed = int.from_bytes(hashlib.sha256(str(time.monotonic_ns()).encode()).digest()[:4], "little")
    span = end - start
    for i in range(200):
        port = start + (seed + i * 7919) % span
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_config(
    model: str,
    port: int,
    policy: str = "recompute",
    lease_s: float = 30.0,
    tp: int = 1,
    extra: Optional[dict] = None,
    dp: int = 0,
) -> Any:
    """The config of one instance of ``tp`` tensor-parallel ranks (its
    data-parallel rank ``dp``, as vLLM's DP launcher sets it); its engine
    id is fixed by its port and DP rank, so a worker process building its
    own config is the same engine."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=model, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=1024)
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=2048,
            max_model_len=1024,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvpollConnector",
            kv_connector_module_path="kvpoll.vllm",
            kv_role="kv_both",
            engine_id=f"engine-{port}" + (f"_dp{dp}" if dp else ""),
            kv_load_failure_policy=policy,
            kv_connector_extra_config={
                "side_channel_port": port,
                "ucx_tls": "tcp",
                "lease_s": lease_s,
                "handshake_timeout_s": 2.0,
                **(extra or {}),
            },
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        device_config=DeviceConfig("cpu"),
    )
    config.parallel_config.data_parallel_index = dp
    return config


def kv_cache_config(tp: int = 1) -> Any:
    """One rank's KV cache config: its share of the KV heads."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                [layer_name(i) for i in range(LAYERS)],
                FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS // tp, head_size=HEAD, dtype=torch.float32),
            )
        ],
    )


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def scheduler(config: Any) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(),
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=True,
    )


_hash_ready = False


def request(req_id: str, prompt: List[int], max_tokens: int, params: Optional[Dict[str, Any]]) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    sp.update_from_generation_config({}, EOS)
    r = Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    r.kv_transfer_params = params
    return r


def assert_scheduler_empty(s: Any) -> None:
    """No request left anywhere, every block free again."""
    assert not s.requests, list(s.requests)
    assert not s.waiting and not s.running
    assert not s.finished_req_ids
    assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
    mgr = s.kv_cache_manager.coordinator.single_type_managers[0]
    assert not mgr.req_to_blocks
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)


def fill_pattern(req_id: str, index: int, nbytes: int, rank: int = 0, tp: int = 1) -> bytes:
    """What the simulated forward pass writes into block ``index`` of a
    request, in every layer: of ``nbytes`` bytes for all KV heads, rank
    ``rank`` of ``tp`` holding its share (the heads are outermost in a
    block, so its share is one range)."""
    d = hashlib.blake2b(f"{req_id}:{index}".encode(), digest_size=64).digest()
    share = nbytes // tp
    return (d * (nbytes // len(d) + 1))[rank * share : (rank + 1) * share]


# ---------------------------------------------------------------- workers


def worker_connector(
    model: str,
    port: int,
    policy: str = "recompute",
    lease_s: float = 30.0,
    rank: int = 0,
    tp: int = 1,
    extra: Optional[dict] = None,
    dp: int = 0,
) -> Tuple[Any, Dict[str, Any]]:
    """A KvpollConnector worker, rank ``rank`` of ``tp``, with its KV
    caches (the CPU backend's layout: [num_blocks, kv_heads / tp,
    block_size, 2 * head]) registered."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    import kvpoll.vllm
    from kvpoll.vllm import KvpollConnector

    # vLLM's tensor-parallel group, as the connector asks it: this
    # process stands for one rank of it.
    kvpoll.vllm._tp_rank = lambda: rank
    config = vllm_config(model, port, policy, lease_s, tp, extra, dp)
    conn = KvpollConnector(config, KVConnectorRole.WORKER, kv_cache_config(tp))
    caches = {layer_name(i): torch.zeros(NUM_BLOCKS, KV_HEADS // tp, BLOCK, 2 * HEAD) for i in range(LAYERS)}
    conn.register_kv_caches(caches)
    return conn, caches


BLOCK_BYTES = KV_HEADS * BLOCK * 2 * HEAD * 4


def _worker_main(
    conn: Any, model: str, port: int, policy: str, lease_s: float, rank: int, tp: int, extra: Optional[dict]
) -> None:
    import torch
    from vllm.v1.outputs import KVConnectorOutput

    try:
        conn_, caches = worker_connector(model, port, policy, lease_s, rank, tp, extra)
    except Exception as e:
        conn.send(("err", type(e).__name__, str(e)))
        return
    conn.send(("ok", None))
    block_bytes = BLOCK_BYTES
    for msg in messages(conn):
        op = msg[0]
        if op == "step":
            _, meta, finished, fills = msg
            for req_id, blocks in fills.items():
                for index, b in blocks:
                    data = torch.frombuffer(
                        bytearray(fill_pattern(req_id, index, block_bytes, rank, tp)), dtype=torch.float32
                    )
                    for t in caches.values():
                        t[b].view(-1).copy_(data)
            conn_.bind_connector_metadata(meta)
            conn_.start_load_kv(None)
            conn_.wait_for_save()
            res = conn_.get_transfer_results(finished)
            out = KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                invalid_block_ids=conn_.get_block_ids_with_load_errors(),
                kv_connector_stats=conn_.get_kv_connector_stats(),
            )
            conn_.clear_connector_metadata()
            conn.send(("ok", out))
        elif op == "dump":
            conn.send(("ok", [b"".join(t[b].numpy().tobytes() for t in caches.values()) for b in msg[1]]))
        elif op == "exit":
            conn_.shutdown()
            conn.send(("ok", None))
            break


class Worker(Child):
    """A connector worker in its own process."""

    def __init__(
        self,
        model: str,
        port: int,
        policy: str = "recompute",
        lease_s: float = 30.0,
        rank: int = 0,
        tp: int = 1,
        extra: Optional[dict] = None,
        wait: bool = True,
    ) -> None:
        """Starts the process; ``wait=False`` leaves ``ready()`` to the
        caller (several start at once)."""
        super().__init__(_worker_main, model, port, policy, lease_s, rank, tp, extra)
        if wait:
            self.ready()

    def ready(self) -> None:
        """Waits until its connector is up (slow on a loaded machine: vLLM
        and torch import in every process)."""
        self.answer(600)

    def step(self, meta: Any, finished: Set[str], fills: Dict[str, List[Tuple[int, int]]]) -> Any:
        return self._ask("step", meta, set(finished), fills)

    def dump(self, blocks: List[int]) -> List[bytes]:
        return self._ask("dump", list(blocks))


def step(
    sched: Any, worker: Union[None, Worker, List[Worker]], sample: int = 7, fill: bool = False
) -> Tuple[Any, Any, List[Any]]:
    """One engine step: schedule, the workers' connector steps (with the
    simulated forward's KV writes if ``fill``), their outputs aggregated
    by vLLM's ``KVOutputAggregator`` when there are several (one per
    tensor-parallel rank), then update_from_output with one sampled token
    per scheduled request. Returns the scheduler output, the (aggregated)
    connector output and the engine-core outputs."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    so = sched.schedule()
    fills: Dict[str, List[Tuple[int, int]]] = {}
    if fill:
        for new in so.scheduled_new_reqs:
            fills[new.req_id] = list(enumerate(new.block_ids[0]))
    workers = worker if isinstance(worker, list) else [worker] if worker else []
    ids = list(so.num_scheduled_tokens)

    def output(kv_out: Any) -> Any:
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[sample] for _ in ids],
            kv_connector_output=kv_out,
        )

    if len(workers) > 1:
        if not hasattr(sched, "kv_aggregator"):
            sched.kv_aggregator = KVOutputAggregator(len(workers))
        outs = [output(w.step(so.kv_connector_metadata, so.finished_req_ids, fills)) for w in workers]
        mro = sched.kv_aggregator.aggregate(outs)
    else:
        mro = output(workers[0].step(so.kv_connector_metadata, so.finished_req_ids, fills) if workers else KVConnectorOutput())
    kv_out = mro.kv_connector_output
    outs = sched.update_from_output(so, mro)
    core_outs = [o for eco in outs.values() for o in eco.outputs]
    return so, kv_out, core_outs


#: One worker, or one per tensor-parallel rank.
Workers = Union[Worker, List[Worker]]
GUARD_S = 120.0


def prefill_all(p: Any, pw: Workers, prompts: Dict[str, List[int]]) -> Dict[str, Dict[str, Any]]:
    """Runs each prompt as a prefill for a remote decode; returns the
    kv_transfer_params of each finished prefill."""
    for rid, prompt in prompts.items():
        p.add_request(request(rid, prompt, 1, {"do_remote_decode": True}))
    params: Dict[str, Dict[str, Any]] = {}
    end = time.monotonic() + GUARD_S
    while len(params) < len(prompts) and time.monotonic() < end:
        _, _, outs = step(p, pw, fill=True)
        for o in outs:
            if o.kv_transfer_params:
                params[o.request_id] = o.kv_transfer_params
    assert set(params) == set(prompts)
    return params


def run_until_empty(p: Any, pw: Workers, d: Any, dw: Workers, on_recv=None) -> Dict[str, List[int]]:
    """Steps both until neither holds a request; returns each decode
    request's sampled tokens."""
    tokens: Dict[str, List[int]] = {}
    end = time.monotonic() + GUARD_S
    while (p.requests or d.requests) and time.monotonic() < end:
        so, kv_out, outs = step(d, dw)
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if on_recv is not None:
            on_recv(so, kv_out)
        step(p, pw)
        time.sleep(0.005)
    # One more step each: the last finished ids reach the workers.
    step(d, dw)
    step(p, pw)
    return tokens


def decode_requests(d: Any, params: Dict[str, Dict[str, Any]], prompts: Dict[str, List[int]], max_tokens: int = 3):
    for rid, prm in params.items():
        d.add_request(request(f"d-{rid}", prompts[rid], max_tokens, dict(prm)))


def logical_blocks(workers: List[Worker], blocks: List[int]) -> List[bytes]:
    """Each block as one unsharded instance would hold it: per layer, the
    ranks' shares of the heads in rank order."""
    tp = len(workers)
    share = BLOCK_BYTES // tp
    dumps = [w.dump(blocks) for w in workers]
    return [
        b"".join(dumps[r][i][layer * share : (layer + 1) * share] for layer in range(LAYERS) for r in range(tp))
        for i in range(len(blocks))
    ]


class Pool:
    """Connector worker processes shared by the tests of a session: one
    set per instance kind (TP size and ``kv_connector_extra_config``),
    one process per rank, each with a fresh scheduler per test. Tests end
    with both schedulers empty, so the next test finds the workers idle."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._made: Dict[Any, Tuple[int, List[Worker]]] = {}

    def get(self, *kinds: Tuple[int, Dict[str, Any]]) -> List[Tuple[Any, List[Worker]]]:
        """A (scheduler, workers) per ``(tp, extra)`` kind; the processes
        of kinds not started yet start together."""
        keys = [(tp, tuple(sorted(extra.items()))) for tp, extra in kinds]
        new = []
        for key in keys:
            if key not in self._made:
                tp, extra = key[0], dict(key[1])
                port = free_port()
                workers = [Worker(self.model, port, rank=r, tp=tp, extra=extra, wait=False) for r in range(tp)]
                self._made[key] = (port, workers)
                new.extend((key, w) for w in workers)
        try:
            for _, w in new:
                w.ready()
        except BaseException:
            # Not kept half started: a later test starts them afresh.
            for key, w in new:
                self._made.pop(key, None)
                w.close()
            raise
        out = []
        for key in keys:
            port, workers = self._made[key]
            out.append((scheduler(vllm_config(self.model, port, tp=key[0], extra=dict(key[1]))), workers))
        return out

    def close(self) -> None:
        for _, workers in self._made.values():
            for w in workers:
                w.close()
