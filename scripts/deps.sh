#!/usr/bin/env bash
# Installs the system packages kvpoll builds against, if they are missing.
# Usage: scripts/deps.sh PKG... [--test PKG...]
# Packages after --test are for tests only (prometheus: promtool validates
# the metrics exposition); they are installed when missing, best effort: a
# test that needs one says so and skips that check.
set -euo pipefail

build=()
test_only=()
for arg in "$@"; do
    case "$arg" in
        --test) mode=test ;;
        *) if [ "${mode:-build}" = test ]; then test_only+=("$arg"); else build+=("$arg"); fi ;;
    esac
done
set -- "${build[@]}"

# Test-only packages, each with the command that shows it is there.
install_test_packages() {
    local missing=()
    for pkg in "${test_only[@]}"; do
        case "$pkg" in
            prometheus) command -v promtool >/dev/null 2>&1 || missing+=("$pkg") ;;
            *) dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg") ;;
        esac
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 && sudo="sudo"
    fi
    if ! command -v apt-get >/dev/null 2>&1 || { [ "$(id -u)" -ne 0 ] && [ -z "$sudo" ]; }; then
        echo "note: tests would also use: ${missing[*]} (not installed)" >&2
        return 0
    fi
    echo "Installing (tests): ${missing[*]}"
    $sudo apt-get update -qq || true
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
        echo "note: could not install ${missing[*]}; the checks that need them are skipped" >&2
}
trap install_test_packages EXIT

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
