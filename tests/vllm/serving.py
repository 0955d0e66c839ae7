"""vLLM's OpenAI server (``vllm serve``) as a deployment runs it: one
process group per instance, started with a KV connector config, asked
over HTTP, read through its /metrics; a word-level tokenizer for the
tiny model so that text prompts map to token ids one for one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any, Dict, List, Optional

#: Tokens "t0".."t511" of the tiny model's vocabulary (0..2 are special).
SPECIAL = {0: "<unk>", 1: "<s>", 2: "</s>"}


def add_tokenizer(model_dir: str, vocab: int = 512) -> str:
    """Saves a word-level tokenizer into ``model_dir``: token i is the word
    ``t<i>``, words are split on spaces, so a prompt of n words is n
    tokens and any token sequence decodes and encodes back to itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {SPECIAL.get(i, f"t{i}"): i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token=SPECIAL[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=SPECIAL[0], bos_token=SPECIAL[1], eos_token=SPECIAL[2]
    )
    fast.save_pretrained(model_dir)
    return model_dir


def kv_config(connector: str, port: int, policy: Optional[str] = None, **extra: Any) -> Dict[str, Any]:
    """``--kv-transfer-config`` for ``connector`` ("kvpoll" or "nixl"):
    kvpoll's side channel on ``port``; NIXL's is set by environment
    (``nixl_env``)."""
    kv: Dict[str, Any] = {"kv_role": "kv_both"}
    if connector == "kvpoll":
        kv.update(
            kv_connector="KvpollConnector",
            kv_connector_module_path="kvpoll.vllm",
            kv_connector_extra_config={"side_channel_port": port, **extra},
        )
    elif connector == "nixl":
        kv.update(kv_connector="NixlConnector", kv_buffer_device="cpu", kv_connector_extra_config=dict(extra))
    else:
        raise ValueError(f"unknown connector {connector!r}")
    if policy:
        kv["kv_load_failure_policy"] = policy
    return kv


def nixl_env(port: int) -> Dict[str, str]:
    """The environment of a NixlConnector instance whose side channel is
    on ``port``."""
    return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}


def server(
    model: str,
    port: int,
    kv: Optional[Dict[str, Any]],
    log: str,
    max_model_len: int = 512,
    tokenizer: bool = False,
    args: Optional[List[str]] = None,
    env: Optional[Dict[str, str]] = None,
    prefix: Optional[List[str]] = None,
    host: str = "127.0.0.1",
) -> subprocess.Popen:
    """``vllm serve`` (its entry point) in a process group of its own;
    ``prefix`` runs it under another command (``ip netns exec NS``)."""
    # vLLM's CPU backend binds each instance's worker threads to the first
    # cores it finds: both instances (and the kvpoll pollers their workers
    # start, which inherit the binding) would share one core, the
    # prefill's engine stepping on it while it holds lent blocks.
    full_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    full_env.update(env or {})
    cmd = list(prefix or []) + [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", host, "--port", str(port), "--dtype", "float32", "--enforce-eager", "--seed", "0"]
    cmd += ["--max-model-len", str(max_model_len)]
    if not tokenizer:
        cmd += ["--skip-tokenizer-init"]
    if kv:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    cmd += list(args or [])
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600.0, log: Optional[str] = None) -> None:
    """Waits until the server at ``url`` answers /health; a failure quotes
    the end of ``log``, if given."""

    def tail() -> str:
        if log is None:
            return ""
        with open(log, errors="replace") as f:
            return ":\n" + f.read()[-2000:]

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, f"the server at {url} exited with {proc.returncode}{tail()}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server at {url} did not come up{tail()}")


def alive(url: str) -> bool:
    """Whether the server (and its engine core: /health asks it) answers."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, wait_s: float = 30.0) -> None:
    """Signals the server's whole process group and waits for it."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(wait_s)


def metrics(url: str, prefix: str = "vllm:") -> Dict[str, float]:
    """The server's /metrics samples named ``prefix...``, summed over
    their labels."""
    out: Dict[str, float] = {}
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(prefix):
                name = line.split("{")[0].split(" ")[0]
                try:
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
                except ValueError:
                    pass
    return out


def read_to_end(sock: socket.socket) -> bytes:
    """What ``sock`` receives until its peer closes."""
    out = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return out
        out += chunk


def post(url: str, body: Dict[str, Any], timeout_s: float = 300.0) -> Dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())
