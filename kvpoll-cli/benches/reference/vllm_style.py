#!/usr/bin/env python3
"""Completion bookkeeping written the way vLLM's NIXL connector writes it,
replaying the same synthetic completion trace as kvpoll's ledger bench.

The connector keeps a dict of request id -> list of transfer handles. Every
engine step it walks every request in flight and asks the transport for the
state of each of its handles ("DONE", "PROC" or an error); a request with no
handle in progress is done and removed; a failed handle puts the request in
a set of failed requests, reported at the step's end (deferred failures).
Here the transport is a dict handle -> state that the trace updates, so the
figure is the bookkeeping alone, with no transport cost at all.

Engine steps: one per window of the trace (`--step` completions), the
friendliest spacing for this design (each handle is re-checked about once);
more frequent steps only re-check more.

    kvpoll bench trace --out /tmp/trace.txt
    python3 kvpoll-cli/benches/reference/vllm_style.py --trace /tmp/trace.txt

Prints one JSON object: completions/s (median of --runs runs), completions
and requests a run. Needs only the standard library.
"""

import argparse
import json
import statistics
import sys
import time

DONE, PROC, ERR = "DONE", "PROC", "ERR"


def load(path):
    with open(path, encoding="ascii") as f:
        header = f.readline().split()
        if header[:2] != ["kvpoll-trace", "1"]:
            sys.exit(f"{path}: not a kvpoll-trace 1 file")
        requests, handles, window, _seed, n_orders = map(int, header[2:7])
        orders = []
        for _ in range(n_orders):
            order = []
            for tok in f.readline().split():
                i, h, ok = tok.split(":")
                order.append((int(i), int(h), ok == "1"))
            orders.append(order)
    return requests, handles, window, orders


class Connector:
    """The connector's receive-side bookkeeping."""

    def __init__(self, transport):
        self._recving_transfers = {}  # request id -> [handle, ...]
        self._failed_recv_reqs = set()
        self.transport = transport  # handle -> state, what check_xfer_state reads

    def check_xfer_state(self, handle):
        return self.transport[handle]

    def release_xfer_handle(self, handle):
        del self.transport[handle]

    def start_load(self, req_id, handles):
        for h in handles:
            self.transport[h] = PROC
        self._recving_transfers[req_id] = handles

    def _pop_done_transfers(self):
        done = set()
        for req_id, handles in list(self._recving_transfers.items()):
            in_progress = False
            for handle in handles:
                state = self.check_xfer_state(handle)
                if state == DONE:
                    continue
                if state == PROC:
                    in_progress = True
                    continue
                self._failed_recv_reqs.add(req_id)
            if not in_progress:
                for handle in handles:
                    self.release_xfer_handle(handle)
                done.add(req_id)
                del self._recving_transfers[req_id]
        return done

    def get_finished(self):
        done = self._pop_done_transfers()
        failed = self._failed_recv_reqs
        self._failed_recv_reqs = set()
        return done - failed, failed


def run(requests, handles, window, orders, step):
    transport = {}
    c = Connector(transport)
    reported = 0
    windows = requests // window
    t0 = time.perf_counter()
    for w in range(windows):
        base = w * window
        for i in range(window):
            rid = base + i
            c.start_load(rid, [rid * 64 + h for h in range(handles)])
        for n, (i, h, ok) in enumerate(orders[w % len(orders)], 1):
            transport[(base + i) * 64 + h] = DONE if ok else ERR
            if n % step == 0:
                done, failed = c.get_finished()
                reported += len(done) + len(failed)
    done, failed = c.get_finished()
    reported += len(done) + len(failed)
    elapsed = time.perf_counter() - t0
    if reported != windows * window:
        sys.exit(f"reported {reported} of {windows * window} requests: a bug")
    return elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--step", type=int, default=0, help="completions per engine step (0: one window)")
    args = ap.parse_args()
    requests, handles, window, orders = load(args.trace)
    step = args.step or window * handles
    completions = (requests // window) * window * handles
    times = [run(requests, handles, window, orders, step) for _ in range(max(1, args.runs))]
    print(
        json.dumps(
            {
                "completions_per_s": completions / statistics.median(times),
                "completions": completions,
                "requests": (requests // window) * window,
                "step": step,
                "runs": len(times),
                "python": sys.version.split()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
