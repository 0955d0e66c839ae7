"""Across hosts: a prefill ``vllm serve`` in a network namespace of its
own, joined to the decode's by a veth pair, as two hosts are by a link;
UCX over tcp on that link alone (``UCX_NET_DEVICES``), the side channel
and the proxy's requests over it too. Greedy, policy ``fail``: each
disaggregated completion is token for token what the decode answers
alone (its prefix cache off, so alone means computed there), and the
veth carried at least the bytes the decode's connector says it read.
Needs root and veth support (``ip netns``); skipped where either is
missing, saying which."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import urllib.error
from typing import Iterator, List, Tuple

import pytest

from harness import free_port
from serving import healthy, kv_config, metrics, post, server, stop

N = 6
MAX_TOKENS = 8


def ip(*args: str) -> bool:
    return subprocess.run(["ip", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


@pytest.fixture(scope="module")
def link() -> Iterator[Tuple[str, str, str, str, str]]:
    """(namespace, host end, namespace end, host address, namespace
    address) of a veth pair whose one end is in a new namespace."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to build a network namespace")
    n = os.getpid() % 200 + 20
    ns, host_if, ns_if = f"kvpoll-vllm-{os.getpid()}", f"kvh{os.getpid() % 100000}", f"kvn{os.getpid() % 100000}"
    host_ip, ns_ip = f"10.79.{n}.1", f"10.79.{n}.2"
    made = ip("netns", "add", ns)
    ok = (
        made
        and ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        and ip("link", "set", ns_if, "netns", ns)
        and ip("addr", "add", f"{host_ip}/24", "dev", host_if)
        and ip("link", "set", host_if, "up")
        and ip("netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/24", "dev", ns_if)
        and ip("netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        and ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
    )
    try:
        if not ok:
            pytest.skip("this machine cannot build a network namespace joined by a veth pair")
        yield ns, host_if, ns_if, host_ip, ns_ip
    finally:
        ip("link", "del", host_if)
        if made:
            ip("netns", "del", ns)


def rx_bytes(dev: str) -> int:
    with open(f"/sys/class/net/{dev}/statistics/rx_bytes") as f:
        return int(f.read())


def test_a_prefill_behind_a_veth_link_serves_token_identical_completions(link, model_dir, tmp_path):
    from kvpoll.vllm.proxy import serve

    ns, host_if, ns_if, host_ip, ns_ip = link
    p_port, d_port = free_port(), free_port()
    prefill = server(
        model_dir,
        p_port,
        kv_config("kvpoll", free_port(), ucx_tls="tcp", side_channel_host=ns_ip),
        str(tmp_path / "prefill.log"),
        env={"UCX_NET_DEVICES": ns_if},
        prefix=["ip", "netns", "exec", ns],
        host=ns_ip,
    )
    # A read may take long on a starved CI machine: the decode waits up to
    # 90 s, within the prefill's default lease (120 s).
    decode = server(
        model_dir,
        d_port,
        kv_config("kvpoll", free_port(), "fail", ucx_tls="tcp", side_channel_host=host_ip, read_deadline_s=90.0),
        str(tmp_path / "decode.log"),
        env={"UCX_NET_DEVICES": host_if},
        args=["--no-enable-prefix-caching"],
    )
    p_url, d_url = f"http://{ns_ip}:{p_port}", f"http://127.0.0.1:{d_port}"
    proxy = serve(p_url, d_url, "127.0.0.1", 0)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        healthy(p_url, prefill)
        healthy(d_url, decode)
        before = rx_bytes(host_if)
        prompts: List[List[int]] = [[(13 * n + 5 * i) % 500 + 3 for i in range(40 + 37 * n)] for n in range(N)]
        for p in prompts:
            body = {"model": model_dir, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}
            try:
                dis = post(f"http://127.0.0.1:{proxy.server_address[1]}/v1/completions", body)["choices"][0]
            except urllib.error.HTTPError as e:
                pytest.fail(f"disaggregated completion: HTTP {e.code} {e.read()[:300]!r}")
            alone = post(d_url + "/v1/completions", body)["choices"][0]
            assert dis["finish_reason"] == "length", dis
            assert dis["token_ids"] == alone["token_ids"]
        crossed = rx_bytes(host_if) - before
        counts = metrics(d_url, "vllm:kvpoll_")
        assert counts["vllm:kvpoll_num_transfers_total"] == N
        assert counts["vllm:kvpoll_num_failed_transfers_total"] == 0
        read = counts["vllm:kvpoll_bytes_transferred_total"]
        assert read > 0 and crossed >= read, f"{read} bytes read, {crossed} crossed the veth"
    finally:
        proxy.shutdown()
        stop(prefill)
        stop(decode)
