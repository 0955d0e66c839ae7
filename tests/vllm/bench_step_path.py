"""What the connector's worker half costs vLLM's step: the time of one
step's calls (``start_load_kv`` with that step's metadata, then
``get_finished``) on a decode worker, with 1, 64 and 512 loads in flight
from a prefill worker in the same process (real UCX, tcp on 127.0.0.1),
and while loads wait for a prefill whose side channel hangs.

    target/vllm-env/bin/python tests/vllm/bench_step_path.py

Prints the unloaded step (the same worker, nothing in flight), the step
that takes N new loads (median of five) and the steps after it while
they are in flight, and the steps while three loads wait on a hung
prefill. Absolute times depend on the machine; the ratios to the
unloaded step in the same run are the figure.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python", "tests"))

from harness import free_port  # noqa: E402
from test_connector_states import Gate, lend, make_worker, meta, remote  # noqa: E402

BLOCKS = 4  # per request
REPEATS = 5


def step_times(d: Any, p: Any, first: Any, until_done: int, bound_s: float = 60.0) -> List[float]:
    """Steps the decode (and the prefill, untimed) until ``until_done``
    loads were reported or ``bound_s`` passed; the decode's step times."""
    times: List[float] = []
    done = 0
    m = first
    end = time.monotonic() + bound_s
    while done < until_done and time.monotonic() < end:
        t0 = time.perf_counter()
        d.start_load_kv(m)
        _, recving = d.get_finished(set())
        times.append(time.perf_counter() - t0)
        m = meta()
        done += len(recving or ())
        p.get_finished(set())
    return times


def idle_steps(d: Any, n: int = 2000) -> List[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        d.start_load_kv(meta())
        d.get_finished(set())
        times.append(time.perf_counter() - t0)
    return times


def summary(ts: List[float]) -> str:
    qs = statistics.quantiles(ts, n=100)
    return f"median {statistics.median(ts) * 1e6:8.1f} us  p99 {qs[98] * 1e6:8.1f} us  ({len(ts)} steps)"


def main() -> None:
    from kvpoll.vllm.metadata import LoadSpec

    n_max = 512
    blocks = n_max * BLOCKS + 8
    p, pc = make_worker(free_port(), blocks)
    d, _ = make_worker(free_port(), blocks)
    try:
        base = idle_steps(d)
        print(f"{'unloaded step':<34} {summary(base)}")
        base_med = statistics.median(base)
        for n in (1, 64, 512):
            firsts: List[float] = []
            rest: List[float] = []
            for rep in range(REPEATS):
                loads = {}
                for i in range(n):
                    rid = f"r{n}-{rep}-{i}"
                    rb = list(range(i * BLOCKS, (i + 1) * BLOCKS))
                    inc = lend(p, pc, rid, rb)
                    loads[f"d-{rid}"] = LoadSpec(list(rb), remote(p, rid, rb, inc))
                # The prefill's lends are in its engine; released once read.
                p.get_finished({f"r{n}-{rep}-{i}" for i in range(n)})
                ts = step_times(d, p, meta(recv=loads), n)
                firsts.append(ts[0])
                rest.extend(ts[1:])
            first = statistics.median(firsts)
            print(f"{f'the step taking {n} loads':<34} median {first * 1e6:8.1f} us  ({first / n * 1e6:.1f} us a load)")
            if len(rest) >= 2:
                print(f"{f'  steps while they are in flight':<34} {summary(rest)}  x{statistics.median(rest) / base_med:.1f} of unloaded")
        # A prefill whose side channel hangs: three loads name it.
        gate = Gate(p.config.side_channel_port)
        try:
            hung = {f"d-h{i}": LoadSpec([i], remote(p, f"h{i}", [i], 1 + i, gate.port)) for i in range(3)}
            d.start_load_kv(meta(recv=hung))
            ts = idle_steps(d, 2000)
            print(f"{'3 loads waiting on a hung prefill':<34} {summary(ts)}  x{statistics.median(ts) / base_med:.1f} of unloaded")
        finally:
            gate.close()
    finally:
        p.shutdown()
        d.shutdown()


if __name__ == "__main__":
    main()
