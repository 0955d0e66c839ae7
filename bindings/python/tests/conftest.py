"""Fixtures: a consumer engine in the test process, producers in their own
processes (kvpoll_remote.Remote), all over real UCX (tcp), adaptive pollers
(a 2-core machine runs every poller and the test at once)."""

from __future__ import annotations

import os
import signal
from typing import Any, Callable, Iterator, List

import pytest

from kvpoll_remote import Remote, new_engine


@pytest.fixture
def make_producer() -> Iterator[Callable[..., Remote]]:
    made: List[Remote] = []

    def make(seed: int = 1, **engine_kwargs: Any) -> Remote:
        r = Remote(seed, **engine_kwargs)
        made.append(r)
        return r

    yield make
    for r in made:
        if r.proc.is_alive():
            try:
                os.kill(r.pid, signal.SIGCONT)  # a test may leave it stopped
            except ProcessLookupError:
                pass
        r.close()


@pytest.fixture
def make_consumer() -> Iterator[Callable[..., Any]]:
    made: List[Any] = []

    def make(**engine_kwargs: Any) -> Any:
        e = new_engine(**engine_kwargs)
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()
