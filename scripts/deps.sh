#!/usr/bin/env bash
# Installs the system packages kvpoll builds against, if they are missing.
# Usage: scripts/deps.sh PKG...
set -euo pipefail

have_all() {
    command -v pkg-config >/dev/null 2>&1 || return 1
    pkg-config --atleast-version=1.10 ucx 2>/dev/null || return 1
    pkg-config --exists hwloc 2>/dev/null || return 1
    pkg-config --exists libudev 2>/dev/null || return 1
    # bindgen loads libclang at build time.
    ls /usr/lib/llvm-*/lib/libclang*.so* /usr/lib/*/libclang*.so* >/dev/null 2>&1 || return 1
    # The C test is compiled with cc; the Python bindings' tests run in a
    # virtual environment (venv needs ensurepip: Debian's python3-venv).
    command -v cc >/dev/null 2>&1 || return 1
    python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || return 1
}

if have_all; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "kvpoll needs these system packages (Debian/Ubuntu names): $*" >&2
    echo "Install UCX >= 1.10, hwloc 2.x, libudev, libclang, pkg-config, a C compiler and Python 3 with venv with your package manager." >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "kvpoll needs: apt-get install -y $*  (run it as root)" >&2
        exit 1
    fi
fi

echo "Installing: $*"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
