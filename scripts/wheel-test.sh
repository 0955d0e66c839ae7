#!/usr/bin/env bash
# Installs kvpoll's wheel (`make wheel`) with pip into a fresh virtual
# environment, as a user without libucx-dev or Rust would (libucx-cu12 comes
# from the package registry, or pip's cache), runs the README's Python quick
# start there, and checks in /proc/self/maps that the libucp the process
# loaded is the libucx wheel's, not the system's.
#
#   scripts/wheel-test.sh [WHEEL_DIR]        (default target/wheels)
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_DIR="${1:-target/wheels}"
VENV="target/wheel-test"
PY="${PYTHON:-python3}"

wheel=$(ls -t "$WHEEL_DIR"/kvpoll-*.whl | head -n 1)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q "$wheel"
# Run from outside the source tree, so that `import kvpoll` is the wheel's.
cd "$VENV"
env -u LD_LIBRARY_PATH bin/python - "$OLDPWD/README.md" <<'PY'
import re, sys

readme = open(sys.argv[1]).read()
quick_start = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
exec(compile(quick_start, "<README quick start>", "exec"), {})

import kvpoll, libucx, os

ucx = kvpoll.ucx_version()
wheel_lib = os.path.realpath(os.path.join(os.path.dirname(libucx.__file__), "lib"))
maps = {line.split()[-1] for line in open("/proc/self/maps") if "libucp.so" in line}
loaded = {os.path.realpath(p) for p in maps}
print("kvpoll", kvpoll.__file__)
print("UCX", ucx)
print("libucp loaded:", ", ".join(sorted(loaded)))
assert loaded and all(os.path.dirname(p) == wheel_lib for p in loaded), (loaded, wheel_lib)
assert ucx["compatible"] and ucx["source"] == "wheel", ucx
assert ucx["loaded"].split(".")[:2] == libucx.__version__.split(".")[:2], (ucx, libucx.__version__)
# The wheel carries the cuda feature: CUDA tensors register where a GPU
# and the wheel UCX's CUDA transports are (refused, saying why, elsewhere).
device = kvpoll.device_memory()
print("device memory:", device)
assert device["cuda_build"] and device["ucx_cuda"] == ucx["cuda"], device
assert (device["refusal"] is None) == (device["driver"] and device["ucx_cuda"]), device
print("wheel test: 1 passed, 0 failed")
PY
