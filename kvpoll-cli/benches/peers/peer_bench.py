#!/usr/bin/env python3
"""Drives another transfer system over the shapes of `kvpoll bench compare`,
two processes, so that its figures sit next to kvpoll's in the same run.

Systems: NIXL (`nixl_agent`, its UCX backend; its progress thread on, as
installed, or off) and Mooncake Transfer Engine
(`mooncake.engine.TransferEngine`, its tcp transport; `in_flight` requests
in flight, each one asynchronous batch), written from their documented
Python APIs. `make bench-peers` installs both into a venv.

The bench runs this script as the initiator; it starts the target (the
same script, `--role target`) as its own child, in the network namespace
`--target-netns` names when one does (a veth link; `--host` is then the
target's address on it). Memory on both sides is an
anonymous mmap (huge pages asked for with madvise), laid out as the kvpoll
bench lays its regions: region-major, `peer_blocks` blocks a region on the
target, `in_flight * blocks_per_request` slots a region on the initiator
(a write's source has the target's layout). Request i names blocks
(i*k + j) mod peer_blocks, j < k, of every region.

Protocol on standard input/output, one line each:
  initiator -> bench:  READY | RESULT <requests> <seconds> <cpu_ns> <checked> <bad>
  bench -> initiator:  RUN <requests>
cpu_ns counts every thread of both processes over the round, less the
checking thread's CPU in its checks; every `check_every`th request's
bytes are compared with the pattern.
"""

import argparse
import ctypes
import mmap
import os
import select
import subprocess
import sys
import time

import numpy as np

MULT = np.uint64(0x9E3779B97F4A7C15)


def cpu_ns(pid):
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


class Memory:
    """An anonymous mapping, faulted in, with a numpy view of its words."""

    def __init__(self, length):
        length = max(length, 1)
        length = (length + (2 << 20) - 1) // (2 << 20) * (2 << 20)
        self.map = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self.map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.words = np.frombuffer(self.map, dtype=np.uint64)
        self.words[:] = 0
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.len = length

    def fill(self, seed, nbytes):
        n = nbytes // 8
        self.words[:n] = np.arange(n, dtype=np.uint64) * MULT + np.uint64(seed)

    def holds(self, offset, length, seed, source_offset):
        """Whether bytes offset..offset+length hold the pattern of `seed`
        at source_offset (where they were copied from)."""
        w0, n = offset // 8, length // 8
        expect = (np.arange(n, dtype=np.uint64) + np.uint64(source_offset // 8)) * MULT + np.uint64(seed)
        return bool(np.array_equal(self.words[w0:w0 + n], expect))


class Layout:
    def __init__(self, a):
        self.bs = a.block_size
        self.regions = a.regions
        self.k = a.blocks_per_request
        self.in_flight = a.in_flight
        self.pb = a.peer_blocks
        self.slots = a.in_flight * a.blocks_per_request

    def target_len(self):
        return self.regions * self.pb * self.bs

    def remote(self, r, i, j):
        """Byte offset, on the target, of block j of request i in region r."""
        return (r * self.pb + (i * self.k + j) % self.pb) * self.bs

    def local(self, r, slot, j, write):
        if write:
            return None
        return (r * self.slots + slot * self.k + j) * self.bs

    def pairs(self, i, slot, write):
        """(local offset, remote offset) of every block of request i."""
        out = []
        for r in range(self.regions):
            for j in range(self.k):
                rem = self.remote(r, i, j)
                out.append((rem if write else (r * self.slots + slot * self.k + j) * self.bs, rem))
        return out


SEED = 0x5EED


def mooncake_engine(mem, host):
    """A Mooncake TransferEngine on tcp at `host` (no metadata server:
    peers handshake directly) with `mem` registered."""
    from mooncake.engine import TransferEngine
    te = TransferEngine()
    if te.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake initialize failed")
    if te.register_memory(mem.addr, mem.len) != 0:
        raise SystemExit("mooncake register_memory failed")
    return te


def nixl_agent_on(name, mem, progress_thread):
    """A NIXL agent (UCX backend) with `mem` registered as DRAM; its
    progress thread on (as installed) or off."""
    from nixl_cu12._api import nixl_agent, nixl_agent_config
    config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    agent = nixl_agent(name, config)
    agent.register_memory([(mem.addr, mem.len, 0, "")], "DRAM")
    return agent


def target_main(a):
    lay = Layout(a)
    mem = Memory(lay.target_len())
    write = a.op == "write"
    if not write:
        mem.fill(SEED, lay.target_len())
    out = sys.stdout
    if a.system == "nixl":
        agent = nixl_agent_on("target", mem, a.progress_thread == "on")
        out.write(f"READY {agent.get_agent_metadata().hex()} {mem.addr:x}\n")
        out.flush()
        line = sys.stdin.readline().split()
        agent.add_remote_agent(bytes.fromhex(line[1]))
    else:
        te = mooncake_engine(mem, a.host)
        out.write(f"READY {a.host}:{te.get_rpc_port()} {mem.addr:x}\n")
        out.flush()
    # Commands: CHECK <request ids...> (a write's destination checks what
    # landed), or end of input. A NIXL agent without its progress thread
    # is progressed here between commands, as its user's serving loop
    # would (each step a call into NIXL, then the core is given up).
    poll = a.system == "nixl" and a.progress_thread == "off"
    for line in lines(sys.stdin, (lambda: agent.get_new_notifs()) if poll else None):
        parts = line.split()
        if parts and parts[0] == "CHECK":
            bad = 0
            for i in map(int, parts[1:]):
                for (_, rem) in lay.pairs(i, 0, True):
                    bad += not mem.holds(rem, lay.bs, SEED, rem)
            out.write(f"CHECKED {bad}\n")
            out.flush()
        if a.system == "nixl":
            agent.get_new_notifs()


def lines(stream, idle):
    """The lines of `stream`; while none is there, `idle()` is called
    over and over (the core given up after each), if given."""
    if idle is None:
        yield from stream
        return
    fd = stream.fileno()
    buf = b""
    while True:
        r, _, _ = select.select([fd], [], [], 0)
        if not r:
            idle()
            os.sched_yield()
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()


def tagged(proc, tag):
    """The next line of `proc` that starts with `tag`, split (the systems'
    own logs may share the stream)."""
    for line in proc.stdout:
        parts = line.split()
        if parts and parts[0] == tag:
            return parts
    raise SystemExit(f"the target ended without {tag}")


def initiator_main(a):
    lay = Layout(a)
    write = a.op == "write"
    local_len = lay.target_len() if write else lay.regions * lay.slots * lay.bs
    mem = Memory(local_len)
    if write:
        mem.fill(SEED, local_len)
    me = os.path.abspath(__file__)
    args = [sys.executable, me, "--role", "target"] + [x for x in sys.argv[1:] if x != "--role" and x != "initiator"]
    if a.target_netns:
        args = ["ip", "netns", "exec", a.target_netns] + args
    target = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = tagged(target, "READY")
    remote_base = int(ready[2], 16)
    op = "WRITE" if write else "READ"
    if a.system == "nixl":
        agent = nixl_agent_on("initiator", mem, a.progress_thread == "on")
        peer = agent.add_remote_agent(bytes.fromhex(ready[1]))
        target.stdin.write(f"META {agent.get_agent_metadata().hex()}\n")
        target.stdin.flush()
        nlocal = lay.target_len() // lay.bs if write else lay.regions * lay.slots
        local_h = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(mem.addr + b * lay.bs, lay.bs, 0) for b in range(nlocal)], "DRAM")
        remote_h = agent.prep_xfer_dlist(
            peer, [(remote_base + b * lay.bs, lay.bs, 0) for b in range(lay.regions * lay.pb)], "DRAM")
        # The metadata exchange completes asynchronously: wait until a
        # transfer can be made.
        t0 = time.monotonic()
        while True:
            try:
                h = agent.make_prepped_xfer(op, local_h, [0], remote_h, [0])
                agent.release_xfer_handle(h)
                break
            except Exception:
                if time.monotonic() - t0 > 30:
                    raise
                time.sleep(0.01)

        def indices(i, slot):
            li, ri = [], []
            for (loc, rem) in lay.pairs(i, slot, write):
                li.append(loc // lay.bs)
                ri.append(rem // lay.bs)
            return li, ri

        def run_waves(first, n, check):
            """Waves of in_flight requests, each wave one NIXL transfer
            (one notification a wave)."""
            done = 0
            while done < n:
                wave = range(first + done, first + min(n, done + a.in_flight))
                li, ri = [], []
                for slot, i in enumerate(wave):
                    l, r = indices(i, slot)
                    li += l
                    ri += r
                h = agent.make_prepped_xfer(op, local_h, li, remote_h, ri, b"d")
                st = agent.transfer(h)
                while st != "DONE":
                    if st == "ERR":
                        raise SystemExit("nixl transfer failed")
                    st = agent.check_xfer_state(h)
                agent.release_xfer_handle(h)
                for slot, i in enumerate(wave):
                    check(i, slot)
                done += len(wave)
            return n

        def run(first, n, check):
            """Keeps in_flight requests going; each one NIXL transfer with a
            notification, as a serving engine's reader sends one."""
            if a.batch:
                return run_waves(first, n, check)
            free = list(range(lay.in_flight))
            going = {}
            nxt = first
            done = 0
            while done < n:
                while free and nxt < first + n:
                    slot = free.pop()
                    li, ri = indices(nxt, slot)
                    h = agent.make_prepped_xfer(op, local_h, li, remote_h, ri, b"d")
                    st = agent.transfer(h)
                    if st == "ERR":
                        raise SystemExit("nixl transfer failed")
                    going[h] = (nxt, slot)
                    nxt += 1
                for h in list(going):
                    st = agent.check_xfer_state(h)
                    if st == "DONE":
                        i, slot = going.pop(h)
                        agent.release_xfer_handle(h)
                        check(i, slot)
                        free.append(slot)
                        done += 1
                    elif st == "ERR":
                        raise SystemExit("nixl transfer failed")
            return n
    else:
        te = mooncake_engine(mem, a.client_host or a.host)
        session = ready[1]
        submit = te.batch_transfer_async_write if write else te.batch_transfer_async_read

        def run(first, n, check):
            """Keeps in_flight requests going, each one asynchronous batch
            of its blocks: a new one is submitted as the oldest ends.
            (`transfer_check_status` looks at a batch's first transfer
            only, so the wait is `get_batch_transfer_status`, which
            returns when the whole batch has ended.)"""
            free = list(range(lay.in_flight))
            going = []
            nxt = first
            done = 0
            while done < n:
                while free and nxt < first + n:
                    slot = free.pop()
                    locs, rems = [], []
                    for (loc, rem) in lay.pairs(nxt, slot, write):
                        locs.append(mem.addr + loc)
                        rems.append(remote_base + rem)
                    batch = submit(session, locs, rems, [lay.bs] * len(locs))
                    if batch <= 0:
                        raise SystemExit(f"mooncake submit failed ({batch})")
                    going.append((batch, nxt, slot))
                    nxt += 1
                batch, i, slot = going.pop(0)
                st = te.get_batch_transfer_status([batch])
                if st != 0:
                    raise SystemExit(f"mooncake transfer failed ({st})")
                check(i, slot)
                free.append(slot)
                done += 1
            return n

    print("READY", flush=True)
    first = 0
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "RUN":
            continue
        n = int(parts[1])
        checked, bad, check_s, check_cpu = 0, 0, 0.0, 0
        to_check = []

        def check(i, slot):
            nonlocal checked, bad, check_s, check_cpu
            if a.check_every == 0 or i % a.check_every:
                return
            checked += 1
            if write:
                to_check.append(i)
                return
            t, c = time.perf_counter(), time.thread_time_ns()
            for (loc, rem) in lay.pairs(i, slot, False):
                bad += not mem.holds(loc, lay.bs, SEED, rem)
            check_s += time.perf_counter() - t
            check_cpu += time.thread_time_ns() - c

        c0 = cpu_ns(os.getpid()) + cpu_ns(target.pid)
        t0 = time.perf_counter()
        done = run(first, n, check)
        secs = time.perf_counter() - t0 - check_s
        cpu = cpu_ns(os.getpid()) + cpu_ns(target.pid) - c0 - check_cpu
        first += done
        if to_check:
            target.stdin.write("CHECK " + " ".join(map(str, to_check)) + "\n")
            target.stdin.flush()
            bad += int(tagged(target, "CHECKED")[1])
        print(f"RESULT {done} {secs:.9f} {cpu} {checked} {bad}", flush=True)
    target.stdin.close()
    try:
        target.wait(timeout=5)
    except subprocess.TimeoutExpired:
        target.kill()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=["nixl", "mooncake"], required=True)
    p.add_argument("--role", choices=["initiator", "target"], default="initiator")
    p.add_argument("--op", choices=["read", "write"], default="read")
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--regions", type=int, default=1)
    p.add_argument("--blocks-per-request", type=int, default=1)
    p.add_argument("--in-flight", type=int, default=1)
    p.add_argument("--peer-blocks", type=int, required=True)
    p.add_argument("--check-every", type=int, default=0)
    p.add_argument("--batch", action="store_true",
                   help="NIXL: one transfer a wave of in_flight requests")
    p.add_argument("--progress-thread", choices=["on", "off"], default="on",
                   help="NIXL: its agents' progress thread (on as installed)")
    p.add_argument("--host", default="127.0.0.1",
                   help="Mooncake: the target's address (the initiator's too, unless --client-host)")
    p.add_argument("--client-host", default="",
                   help="Mooncake: the initiator's own address")
    p.add_argument("--target-netns", default="",
                   help="run the target in this network namespace (ip netns exec)")
    a = p.parse_args()
    if a.role == "target":
        target_main(a)
    else:
        initiator_main(a)


if __name__ == "__main__":
    main()
