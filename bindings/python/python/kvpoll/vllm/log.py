"""The connector's log lines go where vLLM's go: its loggers are children
of vLLM's ``vllm`` logger (``vllm.kvpoll.*``, made by vLLM's
``init_logger``), which vLLM configures (``VLLM_LOGGING_LEVEL``,
``VLLM_LOGGING_CONFIG_PATH``) and which does not propagate to the root
logger. The records of kvpoll's own core (the ``kvpoll`` logger, which
imports nothing from vLLM) are handed to the same logger."""

from __future__ import annotations

import logging
from typing import Any

from vllm.logger import init_logger

#: The parent of every logger of the connector.
VLLM_KVPOLL = "vllm.kvpoll"


def get_logger(module: str) -> Any:
    """The logger of module ``kvpoll.vllm.<name>``: ``vllm.kvpoll.<name>``."""
    return init_logger(VLLM_KVPOLL + module[len("kvpoll.vllm") :])


class _ToVllm(logging.Handler):
    """Passes each record of the ``kvpoll`` logger to vLLM's handlers (by
    way of ``vllm.kvpoll``), filtered by their levels."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(VLLM_KVPOLL).handle(record)


def route_core_logs() -> None:
    """Sends the ``kvpoll`` logger's records to vLLM's log, once; it logs
    at vLLM's level unless its level was set."""
    core = logging.getLogger("kvpoll")
    if any(isinstance(h, _ToVllm) for h in core.handlers):
        return
    core.addHandler(_ToVllm())
    if core.level == logging.NOTSET:
        core.setLevel(logging.getLogger("vllm").getEffectiveLevel())
    # vLLM's handlers have it: the root logger's would print it twice.
    core.propagate = False
