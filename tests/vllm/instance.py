"""A vLLM instance (``vllm.LLM`` on the CPU backend, the tiny local model)
in its own process, driven over a pipe as a disaggregated-serving proxy
drives ``vllm serve``: token-id prompts in, token ids and
``kv_transfer_params`` out."""

from __future__ import annotations

import os
import signal
from typing import Any, Dict, List, Optional

from kvpoll_remote import Child, messages


def _main(
    conn: Any,
    model: str,
    kv: Optional[Dict[str, Any]],
    tp: int,
    max_model_len: int,
    block_size: Optional[int],
    dtype: str = "float32",
) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:
        # More ranks than a small machine has cores to pin them to.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    try:
        llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=max_model_len,
            seed=0,
            tensor_parallel_size=tp,
            distributed_executor_backend="mp" if tp > 1 else None,
            kv_transfer_config=KVTransferConfig(**kv) if kv else None,
            **({"block_size": block_size} if block_size else {}),
        )
    except Exception as e:
        conn.send(("err", type(e).__name__, str(e)))
        return
    conn.send(("ok", None))
    for msg in messages(conn):
        if msg[0] != "generate":
            conn.send(("ok", None))
            break
        _, prompts, max_tokens, params = msg
        sps = [
            SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"kv_transfer_params": p} if p else None)
            for p in params
        ]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
        conn.send(
            (
                "ok",
                [
                    {
                        "token_ids": list(o.outputs[0].token_ids),
                        "finish_reason": o.outputs[0].finish_reason,
                        "kv_transfer_params": o.kv_transfer_params,
                    }
                    for o in outs
                ],
            )
        )


def kv_config(port: int, policy: str = "fail", **extra: Any) -> Dict[str, Any]:
    return {
        "kv_connector": "KvpollConnector",
        "kv_connector_module_path": "kvpoll.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"side_channel_port": port, "ucx_tls": "tcp", **extra},
    }


class Instance(Child):
    """A vLLM instance in its own process; ``ready()`` waits until it
    serves."""

    def __init__(
        self,
        model: str,
        kv: Optional[Dict[str, Any]] = None,
        tp: int = 1,
        max_model_len: int = 512,
        block_size: Optional[int] = None,
        dtype: str = "float32",
    ) -> None:
        # Not a daemon: vLLM starts its engine core as a child process.
        super().__init__(_main, model, kv, tp, max_model_len, block_size, dtype, daemon=False)

    def ready(self, timeout: float = 300.0) -> "Instance":
        self.answer(timeout)
        return self

    def generate(self, prompts: List[List[int]], max_tokens: int, params=None, timeout: float = 300.0) -> List[Dict[str, Any]]:
        return self._ask("generate", prompts, max_tokens, params or [None] * len(prompts), timeout=timeout)

    def processes(self) -> List[Any]:
        """This instance's processes: the front end, its engine core and
        workers (the worker holds the kvpoll engine); none once it exited."""
        import psutil

        try:
            me = psutil.Process(self.proc.pid)
            return [me] + me.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def signal(self, sig: int) -> None:
        import psutil

        for p in self.processes():
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def close(self) -> None:
        procs = self.processes()
        self.signal(signal.SIGCONT)  # a test may leave it stopped
        super().close()
        for p in procs:  # what outlived the front end
            try:
                p.kill()
            except Exception:
                pass


def killed_prefill_drill(p: Instance, d_fail: Instance, d_rec: Instance, prompts: List[List[int]], reference, max_tokens: int) -> None:
    """Prefills ``prompts``, kills the prefill (SIGKILL, every process),
    then loads the first half on a decode of policy recompute (the
    aggregated tokens, ``reference``) and the rest on one of policy fail
    (every one an error: never other tokens)."""
    outs = p.generate(prompts, 1, [{"do_remote_decode": True} for _ in prompts])
    params = [o["kv_transfer_params"] for o in outs]
    assert all(x and x["do_remote_prefill"] for x in params), params[:2]
    p.signal(signal.SIGKILL)
    half = len(prompts) // 2
    rec = d_rec.generate(prompts[:half], max_tokens, params[:half])
    failed = d_fail.generate(prompts[half:], max_tokens, params[half:])
    assert [o["token_ids"] for o in rec] == list(reference[:half])
    assert all(o["finish_reason"] == "error" for o in failed), failed


def decoded_as_aggregated(d: Instance, prompts: List[List[int]], params, reference, max_tokens: int) -> None:
    """Decodes ``prompts`` with the prefill's ``params`` on ``d`` (policy
    fail: a load that did not happen is an error, so identical tokens mean
    the KV came over kvpoll) and checks every answer is the aggregated
    one, ``reference``."""
    outs = d.generate(prompts, max_tokens, params)
    assert [o["finish_reason"] for o in outs] == ["length"] * len(prompts)
    assert [o["token_ids"] for o in outs] == list(reference)
