"""Which KV caches the worker connector takes: host tensors always, CUDA
tensors only where this build, the CUDA driver and the loaded UCX can
register device memory (``kvpoll.device_memory()``), and tensors on any
other device never, each refusal saying why."""

from types import SimpleNamespace

import pytest
import torch

import kvpoll
from kvpoll.vllm.worker import kv_cache_regions


def test_host_layers_become_regions_of_whole_blocks():
    caches = {"l0": torch.zeros(8, 2, 16, 64), "l1": torch.zeros(8, 2, 16, 64)}
    regions, block_bytes = kv_cache_regions(caches, 8)
    assert block_bytes == 2 * 16 * 64 * 4
    assert sorted(regions) == ["l0", "l1"] and len(regions["l0"]) == 1


def test_a_cuda_layer_is_refused_with_what_is_missing_where_device_memory_cannot_be_registered():
    refusal = kvpoll.device_memory()["refusal"]
    if refusal is None:
        pytest.skip("this machine can register CUDA memory: the GPU check covers it")
    # A stand-in with a CUDA device: this machine has no GPU to make one on.
    layer = SimpleNamespace(device=torch.device("cuda", 0), is_contiguous=lambda: True, shape=(8, 4))
    with pytest.raises(ValueError) as e:
        kv_cache_regions({"l0": layer}, 8)
    assert "'l0'" in str(e.value) and "cuda:0" in str(e.value)
    assert refusal in str(e.value)


def test_a_layer_on_another_device_is_refused():
    with pytest.raises(ValueError, match="host memory and CUDA device memory only"):
        kv_cache_regions({"l0": torch.empty(8, 4, device="meta")}, 8)
