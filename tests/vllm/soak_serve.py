"""A serving soak of a prefill/decode pair of ``vllm serve`` instances
behind kvpoll's proxy, driven by vLLM's own benchmark client (``vllm
bench serve``, run here through its entry point because the CPU build's
``vllm`` command asks for a distribution it does not ship), with clients
that give up mid-flight beside it and the prefill killed and restarted
once during the run. Not collected by pytest: run it by hand,

    target/vllm-env/bin/python tests/vllm/soak_serve.py --connector kvpoll
    target/vllm-env/bin/python tests/vllm/soak_serve.py --connector nixl

(vLLM's benchmark client needs pandas, and ``nixl`` the ``nixl``
packages: the script installs what is missing into its environment with
pip, NIXL's without their CUDA dependencies).

Afterwards it checks what a deployment needs: both instances (and their
engine cores) alive; every completed response token for token what an
aggregated instance (no connector, no prefix cache) answers for the same
prompt; both instances' KV caches fully free and their schedulers empty;
no request past its bound. It prints one JSON summary (TTFT, throughput,
errors, wrong answers, abandoned requests, time until the caches were
free) and exits 1 when a check failed."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(__file__))
# The process-over-a-pipe helper the harness imports (as conftest.py sets).
sys.path.insert(1, os.path.join(os.path.dirname(__file__), "..", "..", "bindings", "python", "tests"))

from harness import free_port, tiny_model  # noqa: E402
from serving import add_tokenizer, alive, healthy, kv_config, metrics, nixl_env, post, server, stop  # noqa: E402

MAX_MODEL_LEN = 16640
LONGEST = 16384
VOCAB_WORDS = range(3, 512)


def prompts(n: int, seed: int, longest: int = LONGEST) -> List[Tuple[str, int]]:
    """``n`` (prompt, output tokens): lengths log-uniform from 16 tokens to
    ``longest``, one in twenty exactly ``longest``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = longest if i % 20 == 7 else int(math.exp(rng.uniform(math.log(16), math.log(longest))))
        words = " ".join(f"t{rng.choice(VOCAB_WORDS)}" for _ in range(length))
        out.append((words, rng.randint(8, 48)))
    return out


class Deployment:
    """A prefill, a decode and kvpoll's proxy."""

    def __init__(self, model: str, connector: str, logs: str, policy: Optional[str]) -> None:
        self.model, self.connector, self.logs = model, connector, logs
        self.p_port, self.d_port = free_port(), free_port()
        self.p_side, self.d_side = free_port(), free_port()
        self.policy = policy
        self.prefill = self._start("prefill")
        self.decode = self._start("decode")
        from kvpoll.vllm.proxy import serve

        self.proxy = serve(self.url("prefill"), self.url("decode"), "127.0.0.1", 0, timeout_s=600.0)
        threading.Thread(target=self.proxy.serve_forever, daemon=True).start()
        healthy(self.url("prefill"), self.prefill)
        healthy(self.url("decode"), self.decode)

    def url(self, which: str) -> str:
        return f"http://127.0.0.1:{self.p_port if which == 'prefill' else self.d_port}"

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.server_address[1]}"

    def _start(self, which: str) -> subprocess.Popen:
        port, side = (self.p_port, self.p_side) if which == "prefill" else (self.d_port, self.d_side)
        env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
        if self.connector == "nixl":
            env.update(nixl_env(side))
            # The prefill frees a request's blocks when no decode read them
            # within this long: the same bound as kvpoll's lease.
            env["VLLM_NIXL_ABORT_REQUEST_TIMEOUT"] = "120"
        kv = kv_config(self.connector, side, self.policy)
        log = os.path.join(self.logs, f"{which}.log")
        return server(self.model, port, kv, log, MAX_MODEL_LEN, tokenizer=True, env=env)

    def kill_and_restart_prefill(self) -> float:
        """SIGKILL to the prefill's process group, a new one on the same
        ports; returns the seconds it was away."""
        t0 = time.monotonic()
        stop(self.prefill, signal.SIGKILL)
        self.prefill = self._start("prefill")
        healthy(self.url("prefill"), self.prefill)
        return time.monotonic() - t0

    def close(self) -> None:
        self.proxy.shutdown()
        for proc in (self.prefill, self.decode):
            stop(proc)


def bench(base_url: str, model: str, dataset: str, n: int, concurrency: int, out_dir: str, log: str) -> Dict[str, Any]:
    """``vllm bench serve`` against the proxy; its saved result."""
    code = (
        "import sys\n"
        "from vllm.benchmarks.serve import add_cli_args, main\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "p = FlexibleArgumentParser()\n"
        "add_cli_args(p)\n"
        "main(p.parse_args(sys.argv[1:]))\n"
    )
    args = ["--backend", "vllm", "--base-url", base_url, "--model", model, "--tokenizer", model]
    args += ["--dataset-name", "custom", "--dataset-path", dataset, "--num-prompts", str(n)]
    args += ["--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle", "--ignore-eos", "--temperature", "0"]
    args += ["--max-concurrency", str(concurrency), "--request-rate", "inf"]
    args += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    args += ["--save-result", "--save-detailed", "--result-dir", out_dir, "--result-filename", "bench.json"]
    with open(log, "ab") as f:
        rc = subprocess.call([sys.executable, "-c", code] + args, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"vllm bench serve exited with {rc} (see {log})")
    with open(os.path.join(out_dir, "bench.json")) as f:
        return json.load(f)


def abandon(base_url: str, model: str, work: List[Tuple[str, int]], seed: int, counts: Dict[str, int]) -> None:
    """Streams each request and hangs up after a random moment (before the
    prefill finished, while the decode loads, or mid-decode); counts the
    requests cut before their answer was complete ("abandoned"), those
    answered whole first ("complete") and those answered with an error
    first ("failed")."""
    rng = random.Random(seed)
    for prompt, _ in work:
        body = json.dumps(
            {"model": model, "prompt": prompt, "max_tokens": 256, "temperature": 0, "ignore_eos": True, "stream": True}
        ).encode()
        after = rng.uniform(0.05, 4.0)
        s = socket.create_connection(("127.0.0.1", int(base_url.rsplit(":", 1)[1])), timeout=60)
        try:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            end = time.monotonic() + after
            outcome = "abandoned"
            s.settimeout(0.05)
            got = b""
            while time.monotonic() < end:
                try:
                    b = s.recv(65536)
                except socket.timeout:
                    continue
                got += b
                if b"[DONE]" in got:
                    outcome = "complete"
                    break
                if not b:
                    outcome = "failed"
                    break
        finally:
            s.close()
        counts[outcome] += 1


def reference_answers(model: str, logs: str, work: List[Tuple[str, int]]) -> List[str]:
    """What one aggregated instance (no connector, no prefix cache)
    answers for each (prompt, output tokens), greedy, one at a time."""
    port = free_port()
    proc = server(
        model,
        port,
        None,
        os.path.join(logs, "reference.log"),
        MAX_MODEL_LEN,
        tokenizer=True,
        args=["--no-enable-prefix-caching"],
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        healthy(url, proc)
        out = []
        for prompt, n in work:
            body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            out.append(post(url + "/v1/completions", body, 900)["choices"][0]["text"])
        return out
    finally:
        stop(proc)


def quiet(urls: List[str], bound_s: float) -> Tuple[Optional[float], Dict[str, Dict[str, float]]]:
    """Seconds until every instance's KV cache is free and its scheduler
    empty (None if not within ``bound_s``), and what each reported last."""
    t0 = time.monotonic()
    last: Dict[str, Dict[str, float]] = {}
    while True:
        done = True
        for u in urls:
            m = metrics(u)
            last[u] = {
                k: m.get(k, float("nan"))
                for k in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
            }
            if any(v != 0 for v in last[u].values()):
                done = False
        if done:
            return time.monotonic() - t0, last
        if time.monotonic() - t0 > bound_s:
            return None, last
        time.sleep(2)


def ensure(module: str, packages: List[str], no_deps: bool = False) -> None:
    """Installs ``packages`` into this environment unless ``module`` imports."""
    try:
        __import__(module)
    except ImportError:
        cmd = [sys.executable, "-m", "pip", "install", "-q"] + (["--no-deps"] if no_deps else []) + packages
        subprocess.check_call(cmd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connector", choices=["kvpoll", "nixl"], default="kvpoll")
    ap.add_argument("--requests", type=int, default=240, help="requests vllm bench serve sends")
    ap.add_argument("--abandoned", type=int, default=36, help="requests sent to be given up mid-flight")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kill-after", type=float, default=0.3, help="kill the prefill once this share of the run is done")
    ap.add_argument("--policy", default=None, help="kv_load_failure_policy (vLLM's default when unset)")
    ap.add_argument("--out", default=None, help="folder for logs and results (a new temporary one by default)")
    ap.add_argument("--model", default=None, help="a tiny model folder made earlier (made anew by default)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    ensure("pandas", ["pandas"])
    if a.connector == "nixl":
        ensure("nixl._api", ["nixl==1.5.1", "nixl-cu12==1.5.1", "nixl-cu13==1.5.1"], no_deps=True)
    out = a.out or tempfile.mkdtemp(prefix=f"soak-{a.connector}-")
    os.makedirs(out, exist_ok=True)
    model = a.model
    if model is None or not os.path.exists(os.path.join(model, "tokenizer.json")):
        model = add_tokenizer(tiny_model(model or os.path.join(out, "model"), max_positions=MAX_MODEL_LEN))
    work = prompts(a.requests, a.seed)
    dataset = os.path.join(out, "prompts.jsonl")
    with open(dataset, "w") as f:
        for p, n in work:
            f.write(json.dumps({"prompt": p, "output_tokens": n}) + "\n")
    gave_up = prompts(a.abandoned, a.seed + 1)

    dep = Deployment(model, a.connector, out, a.policy)
    summary: Dict[str, Any] = {"connector": a.connector, "out": out}
    try:
        counts = {"abandoned": 0, "complete": 0, "failed": 0}
        # Two clients giving up, beside the benchmark's.
        quitters = [
            threading.Thread(target=abandon, args=(dep.proxy_url, model, gave_up[i::2], a.seed + i, counts))
            for i in range(2)
        ]
        result: Dict[str, Any] = {}

        def run_bench() -> None:
            result.update(bench(dep.proxy_url, model, dataset, a.requests, a.concurrency, out, os.path.join(out, "bench.log")))

        t0 = time.monotonic()
        runner = threading.Thread(target=run_bench)
        runner.start()
        for q in quitters:
            q.start()
        # The kill, once the benchmark's requests are this far along:
        # counted from the proxy's answers is not possible from here, so
        # by the decode's finished-request counter.
        killed = False
        while runner.is_alive():
            runner.join(2)
            if killed:
                continue
            try:
                done = metrics(dep.url("decode")).get("vllm:request_success_total", 0.0)
            except OSError:
                continue
            if done >= a.kill_after * a.requests:
                summary["prefill_away_s"] = round(dep.kill_and_restart_prefill(), 1)
                summary["prefill_killed_at_s"] = round(time.monotonic() - t0, 1)
                killed = True
        for q in quitters:
            q.join()
        summary["run_s"] = round(time.monotonic() - t0, 1)
        summary["prefill_killed"] = killed
        summary["abandoned"] = counts["abandoned"]
        summary["abandoned_but_completed_first"] = counts["complete"]
        summary["abandoned_but_failed_first"] = counts["failed"]
        if not result:
            raise RuntimeError("vllm bench serve gave no result")

        # Every lease or abort timeout is 120 s: the caches are free by then.
        free_s, last = quiet([dep.url("prefill"), dep.url("decode")], 180.0)
        summary["caches_free_after_s"] = None if free_s is None else round(free_s, 1)
        summary["last_metrics"] = last
        summary["prefill_alive"] = alive(dep.url("prefill"))
        summary["decode_alive"] = alive(dep.url("decode"))
        if a.connector == "kvpoll":
            summary["kvpoll"] = {
                which: metrics(dep.url(which), "vllm:kvpoll_") for which in ("prefill", "decode")
            }
    finally:
        dep.close()

    texts = result.get("generated_texts") or []
    errors = result.get("errors") or []
    ok = [i for i, e in enumerate(errors) if not e and texts[i]]
    ref = reference_answers(model, out, [work[i] for i in ok])
    wrong = [i for i, r in zip(ok, ref) if texts[i] != r]
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"ids": ok, "texts": ref}, f)
    e2el = [x for x in (result.get("latencies") or []) if x]
    summary.update(
        requests=a.requests,
        completed=result.get("completed"),
        failed=a.requests - (result.get("completed") or 0),
        identical=len(ok) - len(wrong),
        wrong=len(wrong),
        wrong_ids=wrong[:20],
        longest_prompt_completed=max((len(work[i][0].split()) for i in ok), default=0),
        ttft_ms_p50=result.get("p50_ttft_ms"),
        ttft_ms_p99=result.get("p99_ttft_ms"),
        tpot_ms_p50=result.get("p50_tpot_ms"),
        output_tok_s=result.get("output_throughput"),
        e2el_s_max=round(max(e2el), 1) if e2el else None,
        error_kinds=sorted({(e or "").strip().splitlines()[-1][:120] for e in errors if e})[:10],
    )
    checks = {
        "both alive": summary["prefill_alive"] and summary["decode_alive"],
        "no wrong tokens": not wrong,
        "caches free": summary["caches_free_after_s"] is not None,
        "prefill killed": summary["prefill_killed"],
        ">= 10% abandoned": summary["abandoned"] >= 0.1 * (a.requests + a.abandoned),
        "no request past its bound": summary["e2el_s_max"] is not None and summary["e2el_s_max"] < 600,
    }
    summary["checks"] = checks
    print(json.dumps(summary, indent=1))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
