#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU: builds kvpoll
# with the `cuda` feature, allocates a device region, registers it with UCX
# as CUDA memory, moves one block host->GPU (UCX get) and GPU->host (UCX put),
# and prints the result.
#
# UCX must have CUDA transports for the transfer (Debian/Ubuntu's libucx
# has none). By default the check builds against UCX 1.22 from the
# libucx-cu12 wheel (scripts/ucx-wheel-env.sh), which carries cuda_copy and
# cuda_ipc, in its own target dir; to use another UCX, name its prefix:
#   KVPOLL_UCX_HOME=/opt/ucx scripts/gpu-check.sh
#
# Exit: 0 block intact both ways; 1 failure; 3 no GPU or no CUDA-enabled UCX.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -z "${KVPOLL_UCX_HOME:-}" ]; then
    KVPOLL_UCX_HOME="$(./scripts/ucx-wheel-env.sh)" || exit 1
fi
export KVPOLL_UCX_HOME
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/gpu}"
PATH="$KVPOLL_UCX_HOME/bin:$PATH"
export LD_LIBRARY_PATH="$KVPOLL_UCX_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

echo "== GPUs"
nvidia-smi -L 2>/dev/null || echo "(nvidia-smi not found)"
echo "== UCX"
if command -v ucx_info >/dev/null; then
    ucx_info -v | head -3
    ucx_info -d 2>/dev/null | grep -E "Transport: cuda|Memory domain: cuda" | sort -u \
        || echo "(this UCX lists no CUDA transports)"
else
    echo "(ucx_info not found)"
fi
echo "== build"
cargo build --release --features cuda --example gpu_check || exit 1
echo "== typed-error tests"
cargo test --release --features cuda --test gpu || exit 1
echo "== one block through GPU memory"
"$CARGO_TARGET_DIR/release/examples/gpu_check" "$@"
rc=$?
echo "gpu_check exit: $rc"
exit $rc
