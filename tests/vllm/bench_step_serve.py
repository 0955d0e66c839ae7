"""What each connector costs vLLM's step in a served deployment, kvpoll's
and NixlConnector's measured the same way one after the other: a prefill
and a decode ``vllm serve`` behind kvpoll's proxy, their connectors
wrapped so that the calls on the step path are timed
(timed_connector.py: ``build_connector_meta``, ``start_load_kv``,
``get_transfer_results``), under 1, 64 and 512 clients at once; then the
decode's inter-token latency for a request of its own, unloaded and while
eight loads wait on a prefill stopped with SIGSTOP. Not collected by
pytest; run by hand:

    target/vllm-env/bin/python tests/vllm/bench_step_serve.py

(installs NIXL's packages into its environment without their CUDA
dependencies when they are missing). Prints one table per figure and the
JSON it came from; absolute times depend on the machine, the ratios of
the two connectors in the same run are the figure."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "..", "..", "bindings", "python", "tests"))

from harness import free_port, tiny_model  # noqa: E402
from serving import healthy, nixl_env, post, server, stop  # noqa: E402

CALLS = ("build_connector_meta", "start_load_kv", "get_transfer_results")
PROMPT = 64
MAX_TOKENS = 16


def kv(connector: str, side: int) -> Dict[str, Any]:
    cfg: Dict[str, Any] = {"kv_role": "kv_both", "kv_connector_module_path": "timed_connector"}
    if connector == "kvpoll":
        cfg.update(kv_connector="TimedKvpollConnector", kv_connector_extra_config={"side_channel_port": side})
    else:
        cfg.update(kv_connector="TimedNixlConnector", kv_buffer_device="cpu")
    return cfg


class Pair:
    def __init__(self, model: str, connector: str, out: str) -> None:
        self.out = out
        self.ports = {"prefill": free_port(), "decode": free_port()}
        self.procs: Dict[str, Any] = {}
        for which in ("prefill", "decode"):
            times = os.path.join(out, which)
            os.makedirs(times, exist_ok=True)
            side = free_port()
            env = {"KVPOLL_STEP_TIMES": times, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
            if connector == "nixl":
                env.update(nixl_env(side))
            self.procs[which] = server(
                model,
                self.ports[which],
                kv(connector, side),
                os.path.join(out, f"{which}.log"),
                args=["--max-num-seqs", "512", "--max-num-batched-tokens", "8192", "--no-enable-prefix-caching"],
                env=env,
            )
        for which, proc in self.procs.items():
            healthy(self.url(which), proc)
        from kvpoll.vllm.proxy import serve

        self.proxy = serve(self.url("prefill"), self.url("decode"), "127.0.0.1", 0, timeout_s=600.0)
        threading.Thread(target=self.proxy.serve_forever, daemon=True).start()

    def url(self, which: str) -> str:
        return f"http://127.0.0.1:{self.ports[which]}"

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.server_address[1]}"

    def close(self) -> None:
        self.proxy.shutdown()
        for proc in self.procs.values():
            os.killpg(proc.pid, signal.SIGCONT)
            stop(proc)


def prompt(rng: random.Random) -> List[int]:
    return [rng.randrange(3, 500) for _ in range(PROMPT)]


def load_phase(pair: Pair, model: str, clients: int, per_client: int, seed: int) -> Tuple[float, float, int]:
    """``clients`` threads each sending ``per_client`` requests through
    the proxy, one after the other; the window in which all of them were
    sending, and the errors."""
    errors = [0]
    started = threading.Barrier(clients + 1)
    finished_first = threading.Event()

    def client(i: int) -> None:
        rng = random.Random(seed * 100003 + i)
        started.wait()
        for _ in range(per_client):
            body = {"model": model, "prompt": prompt(rng), "max_tokens": MAX_TOKENS, "temperature": 0}
            try:
                post(pair.proxy_url + "/v1/completions", body, 600)
            except Exception:
                errors[0] += 1
        finished_first.set()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    started.wait()
    t0 = time.monotonic()
    finished_first.wait()
    t1 = time.monotonic()
    for t in threads:
        t.join()
    return t0, t1, errors[0]


def samples(folder: str, t0: float, t1: float) -> Dict[str, List[float]]:
    out: Dict[str, List[float]] = {c: [] for c in CALLS}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                t, call, s = line.split()
                if t0 <= float(t) <= t1 and call in out:
                    out[call].append(float(s))
    return out


def itl_ms(url: str, model: str, seed: int) -> float:
    """The median gap between the tokens of one streamed request the
    decode serves alone (no transfer), in milliseconds."""
    import http.client

    rng = random.Random(seed)
    body = {"model": model, "prompt": prompt(rng), "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
    host, port = url.rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    stamps = []
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    conn.close()
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    return statistics.median(gaps) * 1e3


def hung_phase(pair: Pair, model: str, seed: int) -> Dict[str, float]:
    """The decode's inter-token latency alone, then while eight loads
    wait on its prefill, stopped with SIGSTOP after answering them."""
    base = statistics.median(itl_ms(pair.url("decode"), model, seed + i) for i in range(3))
    rng = random.Random(seed)
    params = []
    prompts = [prompt(rng) for _ in range(8)]
    for p in prompts:
        first = {"model": model, "prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        params.append(post(pair.url("prefill") + "/v1/completions", first)["kv_transfer_params"])
    os.killpg(pair.procs["prefill"].pid, signal.SIGSTOP)
    waiting = []
    try:
        for p, prm in zip(prompts, params):
            body = {"model": model, "prompt": p, "max_tokens": 4, "temperature": 0, "kv_transfer_params": prm}
            t = threading.Thread(target=lambda b=body: _quiet_post(pair.url("decode") + "/v1/completions", b), daemon=True)
            t.start()
            waiting.append(t)
        time.sleep(2.0)
        hung = statistics.median(itl_ms(pair.url("decode"), model, seed + 10 + i) for i in range(3))
    finally:
        os.killpg(pair.procs["prefill"].pid, signal.SIGCONT)
    for t in waiting:
        t.join(120)
    return {"itl_ms_unloaded": base, "itl_ms_loads_on_stopped_prefill": hung}


def _quiet_post(url: str, body: Dict[str, Any]) -> None:
    try:
        post(url, body, 300)
    except Exception:
        pass


def run(connector: str, model: str, out: str, levels: List[int]) -> Dict[str, Any]:
    pair = Pair(model, connector, out)
    result: Dict[str, Any] = {"levels": {}}
    try:
        load_phase(pair, model, 4, 4, 0)  # handshakes and warm-up, not counted
        for n in levels:
            t0, t1, errors = load_phase(pair, model, n, max(3, 192 // n), n)
            level: Dict[str, Any] = {"window_s": round(t1 - t0, 1), "errors": errors}
            for which in ("prefill", "decode"):
                for call, xs in samples(os.path.join(out, which), t0, t1).items():
                    if xs:
                        q = statistics.quantiles(xs, n=100) if len(xs) >= 2 else [xs[0]] * 99
                        level[f"{which}.{call}"] = {
                            "median_us": statistics.median(xs) * 1e6,
                            "p99_us": q[98] * 1e6,
                            "calls": len(xs),
                        }
            result["levels"][n] = level
        result["hung"] = hung_phase(pair, model, 7)
    finally:
        pair.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connectors", default="kvpoll,nixl")
    ap.add_argument("--levels", default="1,64,512")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="step-serve-")
    connectors = a.connectors.split(",")
    if "nixl" in connectors:
        from soak_serve import ensure

        ensure("nixl._api", ["nixl==1.5.1", "nixl-cu12==1.5.1", "nixl-cu13==1.5.1"], no_deps=True)
    model = tiny_model(os.path.join(out, "model"))
    levels = [int(x) for x in a.levels.split(",")]
    results = {c: run(c, model, os.path.join(out, c), levels) for c in connectors}
    print(json.dumps(results, indent=1))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    names = connectors
    print(f"\n{'clients':>7} {'call':<30} " + " ".join(f"{c + ' median/p99 us':>26}" for c in names) + "  ratio")
    for n in levels:
        for which in ("prefill", "decode"):
            for call in CALLS:
                key = f"{which}.{call}"
                cells = [results[c]["levels"][n].get(key) for c in names]
                if not any(cells):
                    continue
                text = " ".join(
                    f"{cell['median_us']:>12.1f}/{cell['p99_us']:<13.1f}" if cell else f"{'-':>26}" for cell in cells
                )
                ratio = ""
                if len(cells) == 2 and all(cells):
                    ratio = f"{cells[0]['median_us'] / cells[1]['median_us']:.2f}x"
                print(f"{n:>7} {key:<30} {text}  {ratio}")
    print()
    for c in names:
        h = results[c]["hung"]
        print(
            f"{c}: decode inter-token latency {h['itl_ms_unloaded']:.1f} ms unloaded, "
            f"{h['itl_ms_loads_on_stopped_prefill']:.1f} ms with 8 loads on a stopped prefill"
        )


if __name__ == "__main__":
    main()
