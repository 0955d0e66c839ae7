"""The connector logs through vLLM's logging: its lines (and those of
kvpoll's core under it) come out of vLLM's handler, in vLLM's format and
at vLLM's level, as in a ``vllm serve`` log."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r"""
import logging, sys
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging

configure_logging(LoggingConfig())  # what vLLM's engine processes do
import kvpoll.connector
from harness import free_port, worker_connector
from kvpoll.vllm.metadata import KvpollConnectorMetadata, LoadSpec

conn, _ = worker_connector(sys.argv[1], free_port())
# A load that fails before it reaches the engine logs why, once.
conn.connector_worker.start_load_kv(
    KvpollConnectorMetadata(reqs_to_recv={"req-1": LoadSpec([3], None, "the prefill went away")})
)
kvpoll.connector.logger.warning("kvpoll: from the core")
kvpoll.connector.logger.debug("kvpoll: core debug line")
"""


def test_connector_and_core_lines_come_out_of_vllms_handler_in_its_format_and_level(model_dir):
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO", VLLM_CONFIGURE_LOGGING="1")
    env.pop("VLLM_LOGGING_CONFIG_PATH", None)
    here = os.path.dirname(os.path.abspath(__file__))
    # The harness, and the helpers it imports (see conftest.py).
    paths = [here, os.path.join(here, "..", "..", "bindings", "python", "tests"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, model_dir],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # vLLM's handler writes to stdout (VLLM_LOGGING_STREAM), each line
    # with the level and the caller's file and line.
    lines = out.stdout.splitlines()
    worker = [line for line in lines if "load of req-1 failed: the prefill went away" in line]
    assert len(worker) == 1, out.stdout[-2000:]
    assert "WARNING" in worker[0] and "[worker.py:" in worker[0], worker[0]
    core = [line for line in lines if "kvpoll: from the core" in line]
    assert len(core) == 1 and "WARNING" in core[0], out.stdout[-2000:]
    assert "core debug line" not in out.stdout + out.stderr  # below vLLM's level
    assert "kvpoll:" not in out.stderr, out.stderr[-2000:]  # nothing past vLLM's handler
