"""The Python examples of the READMEs run as written, and what help() shows
is documented."""

from __future__ import annotations

import pathlib
import re

import kvpoll
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
READMES = [ROOT / "README.md", ROOT / "bindings/python/README.md"]


def examples():
    for path in READMES:
        text = path.read_text(encoding="utf-8")
        for n, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
            if "import vllm" in block or "from vllm" in block:
                continue  # the adapter sketch needs vLLM
            yield pytest.param(block, id=f"{path.relative_to(ROOT)}#{n}")


@pytest.mark.parametrize("code", list(examples()))
def test_readme_example_runs(code):
    exec(compile(code, "<README>", "exec"), {})


def test_every_public_engine_method_has_a_docstring():
    public = [n for n in dir(kvpoll.Engine) if not n.startswith("_")]
    assert {"read", "write", "lend", "receive", "poll", "shutdown", "register_buffer"} <= set(public)
    undocumented = [n for n in public if not (getattr(kvpoll.Engine, n).__doc__ or "").strip()]
    assert undocumented == []
    assert "exactly once" in " ".join(kvpoll.Engine.__doc__.split())


def test_an_idle_poll_is_an_empty_false_result_whose_containers_are_fresh():
    with kvpoll.Engine(block_size=4096, tls="tcp") as e:
        e.register(4)
        a, b = e.poll(), e.poll()
        assert not a and len(a) == 0
        a.finished_recving.add("x")
        a.failed_recving["y"] = [1]
        assert b.finished_recving == set() and b.failed_recving == {}
        e.read("z", [])
        while not (r := e.poll()):
            pass
        assert len(r) == 1 and r.finished_recving == {"z"}
        assert r.finished_recving is r.finished_recving  # one set per result
