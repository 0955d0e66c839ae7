"""Which UCX the module runs on, and what it refuses on it."""

import os

import pytest

import kvpoll


def test_ucx_version_names_the_library_loaded_and_the_one_built_against():
    v = kvpoll.ucx_version()
    assert v["compatible"] is True
    assert v["source"] in ("pkg-config", "prefix", "wheel")
    # Built against and loaded: the same release here.
    assert v["loaded"].split(".")[:2] == v["built"].split(".")[:2]
    maps = {line.split()[-1] for line in open("/proc/self/maps") if "libucp.so" in line}
    assert maps, "no libucp mapped"
    dirs = {os.path.realpath(os.path.dirname(p)) for p in maps}
    if v["source"] == "wheel":
        # The libucx wheel installed beside kvpoll, wherever the build found it.
        import libucx

        assert dirs == {os.path.realpath(os.path.join(os.path.dirname(libucx.__file__), "lib"))}, dirs
    elif v["source"] == "prefix":
        assert dirs == {os.path.realpath(v["libdir"])}, dirs


class FakeCudaArray:
    """What torch and cupy device arrays expose."""

    __cuda_array_interface__ = {"shape": (4096,), "typestr": "|u1", "data": (0x7F0000000000, False), "version": 3}


def test_a_cuda_array_is_refused_with_why():
    with kvpoll.Engine(block_size=4096) as e:
        with pytest.raises(kvpoll.RegionError) as err:
            e.register_buffer(FakeCudaArray())
        said = str(err.value)
        assert "CUDA array" in said
        if kvpoll.ucx_version()["cuda"]:
            assert "host memory" in said
        else:
            assert "no CUDA memory type" in said
