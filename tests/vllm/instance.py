"""A vLLM instance (``vllm.LLM`` on the CPU backend, the tiny local model)
in its own process, driven over a pipe as a disaggregated-serving proxy
drives ``vllm serve``: token-id prompts in, token ids and
``kv_transfer_params`` out."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any, Dict, List, Optional


def _main(conn: Any, model: str, kv: Optional[Dict[str, Any]]) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    try:
        llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            seed=0,
            kv_transfer_config=KVTransferConfig(**kv) if kv else None,
        )
    except Exception as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] != "generate":
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


class Instance:
    def __init__(self, model: str, kv: Optional[Dict[str, Any]] = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, model, kv))
        self.proc.start()
        child.close()

    def ready(self, timeout: float = 300.0) -> "Instance":
        self._answer(timeout)
        return self

    def _answer(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"vLLM instance {self.proc.pid} did not answer")
        kind, value = self.conn.recv()
        if kind == "err":
            raise RuntimeError(value)
        return value

    def generate(self, prompts: List[List[int]], max_tokens: int, params=None, timeout: float = 300.0) -> List[Dict[str, Any]]:
        self.conn.send(("generate", prompts, max_tokens, params or [None] * len(prompts)))
        return self._answer(timeout)

    def processes(self) -> List[Any]:
        """This instance's processes: the front end, its engine core and
        workers (the worker holds the kvpoll engine)."""
        import psutil

        me = psutil.Process(self.proc.pid)
        return [me] + me.children(recursive=True)

    def signal(self, sig: int) -> None:
        for p in self.processes():
            try:
                p.send_signal(sig)
            except Exception:
                pass

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.signal(signal.SIGCONT)
                self.conn.send(("exit",))
            except OSError:
                pass
            self.proc.join(60)
        if self.proc.is_alive():
            self.signal(signal.SIGKILL)
            self.proc.join(10)
