#!/usr/bin/env python3
"""What kvpoll costs a Python serving engine per step, in nanoseconds, next
to the bookkeeping a vLLM-style connector does instead, all in one run:

- ``poll()`` with nothing new (what every engine step pays when idle);
- a one-block ``read`` submit (one handle, one block per layer);
- the vLLM-style step: a dict of request id -> list of handles, every
  handle's state looked up and every request re-checked each step (the
  shape of vLLM's NIXL connector's ``_pop_done_transfers``), with the
  transport reduced to a dict lookup so that only the bookkeeping counts,
  for 64 and 512 requests in flight, two handles each.

    python bindings/python/bench_poll.py [--rounds 7] [--json]

Each figure is the median over ``--rounds`` rounds, each of many calls;
the loop's own cost (an empty ``for`` loop) is shown, not subtracted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, List

import kvpoll

BS = 4096
BLOCKS = 1024


def per_call(n: int, run: Callable[[int], None]) -> float:
    t0 = time.perf_counter_ns()
    run(n)
    return (time.perf_counter_ns() - t0) / n


def bench_empty_loop(n: int) -> float:
    def run(n: int) -> None:
        for _ in range(n):
            pass

    return per_call(n, run)


def bench_poll_idle(e: kvpoll.Engine, n: int) -> float:
    poll = e.poll

    def run(n: int) -> None:
        for _ in range(n):
            poll()

    return per_call(n, run)


def bench_read_submit(c: kvpoll.Engine, peer: int, batch: int, batches: int, serial: List[int]) -> float:
    """Submits `batch` one-block reads (timed), then drains them (not timed)."""
    handles = [[(peer, [b], [b])] for b in range(batch)]
    total = 0
    for _ in range(batches):
        ids = [f"req-{serial[0] + i}" for i in range(batch)]
        serial[0] += batch
        read = c.read
        t0 = time.perf_counter_ns()
        for i in range(batch):
            read(ids[i], handles[i])
        total += time.perf_counter_ns() - t0
        left = set(ids)
        end = time.monotonic() + 30
        while left:
            r = c.poll()
            left -= r.finished_recving
            if r.failed_recving:
                raise SystemExit(f"reads failed: {r.failure_reasons}")
            if time.monotonic() > end:
                raise SystemExit(f"{len(left)} reads never finished")
    return total / (batch * batches)


DONE, PROC = "DONE", "PROC"


class VllmStyle:
    """The receive-side bookkeeping of a vLLM-style connector."""

    def __init__(self) -> None:
        self.recving: Dict[str, List[int]] = {}
        self.transport: Dict[int, str] = {}  # handle -> state

    def check_xfer_state(self, handle: int) -> str:
        return self.transport[handle]

    def step(self) -> set:
        done = set()
        for req_id, handles in list(self.recving.items()):
            in_progress = False
            for h in handles:
                state = self.check_xfer_state(h)
                if state == DONE:
                    continue
                if state == PROC:
                    in_progress = True
                    continue
            if not in_progress:
                done.add(req_id)
                del self.recving[req_id]
        return done


def bench_python_step(in_flight: int, steps: int) -> float:
    """One engine step with `in_flight` requests, two handles each, none
    done (the steady state between completions: everything re-checked)."""
    c = VllmStyle()
    for r in range(in_flight):
        hs = [2 * r, 2 * r + 1]
        c.recving[f"req-{r}"] = hs
        for h in hs:
            c.transport[h] = PROC

    def run(n: int) -> None:
        for _ in range(n):
            c.step()

    return per_call(steps, run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()

    with kvpoll.Engine(block_size=BS, idle="adaptive") as p, kvpoll.Engine(block_size=BS, idle="adaptive") as c:
        p.register(BLOCKS)
        c.register(BLOCKS)
        peer = c.add_peer(p.local_metadata())
        serial = [0]
        bench_read_submit(c, peer, 256, 2, serial)  # warm up
        rows: Dict[str, List[float]] = {k: [] for k in ("loop", "poll", "read", "py64", "py512")}
        for _ in range(args.rounds):
            rows["loop"].append(bench_empty_loop(200_000))
            rows["poll"].append(bench_poll_idle(c, 200_000))
            rows["read"].append(bench_read_submit(c, peer, 256, 8, serial))
            rows["py64"].append(bench_python_step(64, 2_000))
            rows["py512"].append(bench_python_step(512, 300))

    med = {k: statistics.median(v) for k, v in rows.items()}
    if args.json:
        print(json.dumps({**{k + "_ns": round(v, 1) for k, v in med.items()}, "rounds": args.rounds}))
        return
    lines = [
        ("Engine.poll(), nothing new", med["poll"], "every engine step, idle or not"),
        ("Engine.read(), one handle, one block", med["read"], "once per request"),
        ("vLLM-style step, 64 requests in flight", med["py64"], "every engine step; 2 handles each, re-checked"),
        ("vLLM-style step, 512 requests in flight", med["py512"], "the same, grows with requests in flight"),
        ("(empty Python for-loop iteration)", med["loop"], "included in every figure above"),
    ]
    print(f"{'figure':<44} {'ns':>10}  note")
    for name, ns, note in lines:
        print(f"{name:<44} {ns:>10.1f}  {note}")
    print(
        f"\npoll() vs vLLM-style step: {med['py64'] / med['poll']:.0f}x cheaper at 64 in flight, "
        f"{med['py512'] / med['poll']:.0f}x at 512 (median of {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
