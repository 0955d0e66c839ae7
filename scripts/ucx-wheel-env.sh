#!/usr/bin/env bash
# A virtual environment holding the UCX that Python users install: the
# libucx-cu12 wheel from the package registry (headers, libucp, the cma and
# CUDA transports), plus maturin for building kvpoll's own wheel against it.
# Kept between runs; pip's cache keeps the downloads. Prints the libucx
# package directory, which is a UCX prefix for ucx-sys (KVPOLL_UCX_HOME).
#
#   scripts/ucx-wheel-env.sh [VENV]        (default target/ucx122/venv)
set -euo pipefail
cd "$(dirname "$0")/.."

LIBUCX_VERSION="${LIBUCX_VERSION:-1.22.0}"
VENV="${1:-${KVPOLL_UCX_WHEEL_ENV:-target/ucx122/venv}}"
PY="${PYTHON:-python3}"

have() {
    "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null
}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" >&2
if ! have libucx-cu12 "$LIBUCX_VERSION"; then
    "$VENV/bin/pip" install -q "libucx-cu12==$LIBUCX_VERSION" >&2
fi
"$VENV/bin/python" -c "import maturin" 2>/dev/null ||
    "$VENV/bin/pip" install -q "maturin>=1.5,<2" >&2
"$VENV/bin/python" -c "import libucx, os; print(os.path.dirname(libucx.__file__))"
