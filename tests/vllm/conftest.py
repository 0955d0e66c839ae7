"""The vLLM suite runs in the environment scripts/vllm-env.sh builds."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# The process-over-a-pipe helper the bindings' suite uses.
sys.path.insert(1, os.path.join(os.path.dirname(__file__), "..", "..", "bindings", "python", "tests"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from harness import tiny_model

    return tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def pool(model_dir: str):
    """Connector worker processes shared across tests (see harness.Pool)."""
    from harness import Pool

    p = Pool(model_dir)
    yield p
    p.close()
