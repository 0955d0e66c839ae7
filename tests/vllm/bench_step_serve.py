"""What each connector costs vLLM's step in a served deployment, kvpoll's
and NixlConnector's measured the same way one after the other: a prefill
and a decode ``vllm serve`` behind kvpoll's proxy, their connectors
wrapped so that the calls on the step path are timed
(timed_connector.py: ``build_connector_meta``, ``start_load_kv``,
``get_transfer_results``), under 1, 64 and 512 clients at once (each level on a new pair, for a
minute); then the decode's step time (between its worker's successive
``start_load_kv`` calls) while it decodes a request of its own, unloaded
and while eight loads wait on a prefill stopped with SIGSTOP. Not collected by
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


def load_phase(pair: Pair, model: str, clients: int, seed: int, phase_s: float) -> Tuple[float, float, Dict[str, int]]:
    """``clients`` threads each sending requests through the proxy, one
    after the other, for ``phase_s``; the window and the outcomes.
    Requests still in flight at its end are left to the instances (the
    caller closes them)."""
    started = threading.Barrier(clients + 1)
    outcomes: Dict[str, int] = {}
    lock = threading.Lock()
    end = [0.0]

    def client(i: int) -> None:
        rng = random.Random(seed * 100003 + i)
        started.wait()
        while time.monotonic() < end[0]:
            body = {"model": model, "prompt": prompt(rng), "max_tokens": MAX_TOKENS, "temperature": 0}
            try:
                post(pair.proxy_url + "/v1/completions", body, 600)
                what = "ok"
            except Exception as e:
                what = type(e).__name__
            with lock:
                outcomes[what] = outcomes.get(what, 0) + 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    end[0] = time.monotonic() + phase_s + 30.0
    for t in threads:
        t.start()
    started.wait()
    t0 = time.monotonic()
    end[0] = t0 + phase_s
    time.sleep(phase_s)
    with lock:
        return t0, time.monotonic(), dict(outcomes)


def stamps(folder: str, call: str, t0: float, t1: float) -> List[float]:
    """When each ``call`` in [t0, t1] returned, in order."""
    out: List[float] = []
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                t, c, _ = line.split()
                if c == call and t0 <= float(t) <= t1:
                    out.append(float(t))
    return sorted(out)


def samples(folder: str, t0: float, t1: float) -> Dict[str, List[float]]:
    out: Dict[str, List[float]] = {c: [] for c in CALLS}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                t, call, s = line.split()
                if t0 <= float(t) <= t1 and call in out:
                    out[call].append(float(s))
    return out


def local_request(url: str, model: str, seed: int) -> Tuple[float, float]:
    """One request the decode serves alone (no transfer), 64 tokens; the
    window it ran in."""
    rng = random.Random(seed)
    body = {"model": model, "prompt": prompt(rng), "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    post(url + "/v1/completions", body, 300)
    return t0, time.monotonic()


def step_ms(pair: Pair, window: Tuple[float, float]) -> float:
    """The decode's median step in ``window``: the gap between its
    worker's successive ``start_load_kv`` calls (one a step)."""
    ts = stamps(os.path.join(pair.out, "decode"), "start_load_kv", *window)
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    return statistics.median(gaps) * 1e3 if gaps else float("nan")


def hung_phase(pair: Pair, model: str, seed: int) -> Dict[str, float]:
    """The decode's step while it decodes a request of its own, unloaded,
    then while eight loads wait on its prefill, stopped with SIGSTOP after
    answering them."""
    base = [local_request(pair.url("decode"), model, seed + i) for i in range(3)]
    rng = random.Random(seed)
    params = []
    prompts = [prompt(rng) for _ in range(8)]
    for p in prompts:
        first = {"model": model, "prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        params.append(post(pair.url("prefill") + "/v1/completions", first)["kv_transfer_params"])
    os.killpg(pair.procs["prefill"].pid, signal.SIGSTOP)
    try:
        for p, prm in zip(prompts, params):
            body = {"model": model, "prompt": p, "max_tokens": 4, "temperature": 0, "kv_transfer_params": prm}
            threading.Thread(target=_quiet_post, args=(pair.url("decode") + "/v1/completions", body), daemon=True).start()
        time.sleep(2.0)
        hung = [local_request(pair.url("decode"), model, seed + 10 + i) for i in range(3)]
    finally:
        os.killpg(pair.procs["prefill"].pid, signal.SIGCONT)
    # The worker writes its times down every half second, on a call.
    time.sleep(1.0)
    local_request(pair.url("decode"), model, seed + 20)
    return {
        "step_ms_unloaded": statistics.median(step_ms(pair, w) for w in base),
        "step_ms_loads_on_stopped_prefill": statistics.median(step_ms(pair, w) for w in hung),
    }


def _quiet_post(url: str, body: Dict[str, Any]) -> None:
    try:
        post(url, body, 300)
    except Exception:
        pass


def run(connector: str, model: str, out: str, levels: List[int], phase_s: float) -> Dict[str, Any]:
    """Each level on a pair of its own (what a level leaves in flight
    would weigh on the next), then the stopped-prefill figure on another."""
    result: Dict[str, Any] = {"levels": {}}
    for n in levels:
        folder = os.path.join(out, f"clients-{n}")
        pair = Pair(model, connector, folder)
        try:
            load_phase(pair, model, 4, 0, 5.0)  # handshakes and warm-up, not counted
            time.sleep(5.0)
            t0, t1, outcomes = load_phase(pair, model, n, n, phase_s)
        finally:
            pair.close()
        level: Dict[str, Any] = {"window_s": round(t1 - t0, 1), "requests": outcomes}
        for which in ("prefill", "decode"):
            for call, xs in samples(os.path.join(folder, which), t0, t1).items():
                if xs:
                    q = statistics.quantiles(xs, n=100) if len(xs) >= 2 else [xs[0]] * 99
                    level[f"{which}.{call}"] = {
                        "median_us": statistics.median(xs) * 1e6,
                        "p99_us": q[98] * 1e6,
                        "calls": len(xs),
                    }
        result["levels"][n] = level
    pair = Pair(model, connector, os.path.join(out, "stopped-prefill"))
    try:
        load_phase(pair, model, 4, 0, 5.0)
        time.sleep(5.0)
        result["hung"] = hung_phase(pair, model, 7)
    finally:
        pair.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connectors", default="kvpoll,nixl")
    ap.add_argument("--levels", default="1,64,512")
    ap.add_argument("--out", default=None)
    ap.add_argument("--phase-s", type=float, default=60.0, help="the longest each level's clients send")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="step-serve-")
    connectors = a.connectors.split(",")
    if "nixl" in connectors:
        from soak_serve import ensure

        ensure("nixl._api", ["nixl==1.5.1", "nixl-cu12==1.5.1", "nixl-cu13==1.5.1"], no_deps=True)
    model = tiny_model(os.path.join(out, "model"))
    levels = [int(x) for x in a.levels.split(",")]
    results: Dict[str, Any] = {}
    for c in connectors:
        results[c] = run(c, model, os.path.join(out, c), levels, a.phase_s)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    names = connectors
    failed = 0
    print(f"\n{'clients':>7} {'call':<30} " + " ".join(f"{c + ' median/p99 us':>26}" for c in names) + "  ratio")
    for n in levels:
        for which in ("prefill", "decode"):
            for call in CALLS:
                key = f"{which}.{call}"
                cells = [results[c]["levels"][n].get(key) for c in names]
                # A call never timed in the window is a run that failed,
                # not a blank.
                failed += sum(cell is None for cell in cells)
                text = " ".join(
                    f"{cell['median_us']:>12.1f}/{cell['p99_us']:<13.1f}" if cell else f"{'FAILED: no calls':>26}"
                    for cell in cells
                )
                ratio = ""
                if len(cells) == 2 and all(cells):
                    ratio = f"{cells[0]['median_us'] / cells[1]['median_us']:.2f}x"
                print(f"{n:>7} {key:<30} {text}  {ratio}")
    print()
    for c in names:
        h = results[c]["hung"]
        failed += sum(v != v for v in h.values())  # NaN: no steps seen
        print(
            f"{c}: decode step {h['step_ms_unloaded']:.1f} ms unloaded, "
            f"{h['step_ms_loads_on_stopped_prefill']:.1f} ms with 8 loads on a stopped prefill"
        )
    if failed:
        print(f"FAILED: {failed} figures did not come")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
