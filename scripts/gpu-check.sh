#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU: builds kvpoll
# with the `cuda` feature, allocates a device region, registers it with UCX
# as CUDA memory, moves one block host->GPU (UCX get) and GPU->host (UCX put),
# and prints the result.
#
# UCX must be built with CUDA for the transfer (Debian/Ubuntu's libucx is
# not). To use another UCX, point both the build and the loader at it:
#   PKG_CONFIG_PATH=/opt/ucx/lib/pkgconfig LD_LIBRARY_PATH=/opt/ucx/lib scripts/gpu-check.sh
#
# Exit: 0 block intact both ways; 1 failure; 3 no GPU or no CUDA-enabled UCX.
set -uo pipefail
cd "$(dirname "$0")/.."

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
./target/release/examples/gpu_check "$@"
rc=$?
echo "gpu_check exit: $rc"
exit $rc
