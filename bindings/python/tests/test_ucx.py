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


class FakeCudaTensor:
    """A torch tensor on a GPU whose array interface cannot be read (torch
    raises for bfloat16): it is still device memory."""

    is_cuda = True

    @property
    def __cuda_array_interface__(self):
        raise TypeError("dtype bfloat16 has no array interface")

    def data_ptr(self) -> int:
        return 0x7F0000000000

    def element_size(self) -> int:
        return 2

    def numel(self) -> int:
        return 2048

    def is_contiguous(self) -> bool:
        return True


def test_device_memory_reports_what_this_build_driver_and_ucx_have():
    support = kvpoll.device_memory()
    assert support["ucx_cuda"] == kvpoll.ucx_version()["cuda"]
    if support["cuda_build"]:
        import ctypes

        try:
            ctypes.CDLL("libcuda.so.1")
            found = True
        except OSError:
            found = False
        assert support["driver"] == found
    accepted = support["cuda_build"] and support["driver"] and support["ucx_cuda"]
    assert (support["refusal"] is None) == accepted, support


@pytest.mark.parametrize("array", [FakeCudaArray, FakeCudaTensor])
def test_a_cuda_array_is_refused_naming_what_is_missing_and_nothing_is_registered(array):
    support = kvpoll.device_memory()
    if support["refusal"] is None:
        pytest.skip("CUDA memory can be registered here: scripts/gpu-check.sh moves it")
    with kvpoll.Engine(block_size=4096) as e:
        with pytest.raises(kvpoll.RegionError) as err:
            e.register_buffer(array())
        said = str(err.value)
        assert said.startswith("a CUDA array cannot be registered: "), said
        assert ("without the cuda feature" in said) == (not support["cuda_build"]), said
        assert ("no CUDA driver" in said) == (support["cuda_build"] and not support["driver"]), said
        assert ("has no CUDA memory type" in said) == (not support["ucx_cuda"]), said
        # Nothing was registered: the first region is still region 0.
        assert e.register(4) == 0


def cuda_array(**fields):
    iface = {"shape": (2, 2048), "typestr": "<f2", "data": (0x7F0000000000, False), "version": 3}
    iface.update(fields)
    return type("CudaArray", (), {"__cuda_array_interface__": iface})()


@pytest.mark.parametrize(
    "fields, said",
    [
        ({"data": (0x7F0000000000, True)}, "read-only"),
        ({"strides": (2, 4)}, "not C-contiguous"),
        ({"typestr": "<f"}, "names no item size"),
        ({"shape": (0,)}, "empty"),
        ({"data": "nowhere"}, "'data' is not a"),
    ],
)
def test_a_malformed_cuda_array_is_refused_as_such_on_any_machine(fields, said):
    with kvpoll.Engine(block_size=4096) as e:
        with pytest.raises(ValueError, match=said):
            e.register_buffer(cuda_array(**fields))
        assert e.register(4) == 0


def test_a_c_contiguous_cuda_array_with_its_strides_given_is_read_as_one_range():
    # Strides (4096, 2) are C order for shape (2, 2048) of 2-byte items:
    # what follows the parse is the refusal (or, with a GPU, the driver's
    # check of the address), not a layout error.
    with kvpoll.Engine(block_size=4096) as e:
        with pytest.raises(kvpoll.RegionError, match="CUDA array cannot be registered|not CUDA device memory"):
            e.register_buffer(cuda_array(strides=(4096, 2)))
