#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU: kvpoll built with the
# `cuda` feature against UCX 1.22 from the libucx-cu12 wheel (which has the
# cuda_copy and cuda_ipc transports), KV layers allocated on the device and
# registered as device memory, blocks moved host<->GPU through UCX, then
# pulled and pushed between two engines in one process and pulled between
# two processes, every byte checked (examples/gpu_check.rs); before that the
# typed-error tests (tests/gpu.rs), which on a GPU machine register device
# memory for real. The last line is `GPU CHECK: PASS` or
# `GPU CHECK: FAIL (why)`; the exit status is 0 only on PASS.
#
#   scripts/gpu-check.sh                  build here, then run (needs Rust,
#                                         and the wheel or pip's cache)
#   scripts/gpu-check.sh --prepare DIR    build only (no GPU needed): DIR gets
#                                         the two binaries, stripped, and the
#                                         wheel's UCX libraries (~40 MB)
#   scripts/gpu-check.sh --run DIR        run a prepared DIR (a GPU machine
#                                         with neither Rust nor a network)
#
# Another UCX with CUDA transports: KVPOLL_UCX_HOME=/opt/ucx (a prefix with
# include/ and lib/); --prepare then copies its lib/ instead.
set -uo pipefail
cd "$(dirname "$0")/.."

fail() {
    echo "GPU CHECK: FAIL ($*)"
    exit 1
}

prepare() {
    local dir="$1" home
    home="${KVPOLL_UCX_HOME:-$(./scripts/ucx-wheel-env.sh)}" || fail "no UCX: scripts/ucx-wheel-env.sh failed"
    [ -f "$home/lib/libucp.so.0" ] || fail "no libucp.so.0 under $home/lib"
    local target="${CARGO_TARGET_DIR:-$PWD/target/gpu}"
    # The binaries find the copied UCX beside them, wherever DIR is moved.
    local build=(env KVPOLL_UCX_HOME="$home" KVPOLL_UCX_RPATH='$ORIGIN/libucx/lib'
        CARGO_TARGET_DIR="$target" CARGO_PROFILE_DEV_DEBUG=0)
    echo "== build (UCX at $home)"
    "${build[@]}" cargo build --features cuda --example gpu_check || fail "build of examples/gpu_check.rs"
    local test_exe
    test_exe=$("${build[@]}" cargo test --features cuda --test gpu --no-run --message-format=json |
        grep -o '"executable":"[^"]*"' | tail -n 1 | cut -d'"' -f4)
    [ -x "$test_exe" ] || fail "build of tests/gpu.rs"
    rm -rf "$dir"
    mkdir -p "$dir/libucx/lib/ucx" "$dir/libucx/bin" || fail "cannot create $dir"
    cp "$target/debug/examples/gpu_check" "$dir/gpu_check"
    cp "$test_exe" "$dir/gpu_test"
    strip "$dir/gpu_check" "$dir/gpu_test" 2>/dev/null || true
    # Plain files (no links), under their sonames: what the loader and
    # UCX's module loader (libuct_*.so.0 in lib/ucx beside libucs) open.
    local f
    for f in "$home"/lib/lib*.so.0; do cp -L "$f" "$dir/libucx/lib/"; done
    for f in "$home"/lib/ucx/lib*.so.0; do
        case "$f" in *perftest*) continue ;; esac
        cp -L "$f" "$dir/libucx/lib/ucx/"
    done
    [ -x "$home/bin/ucx_info" ] && cp -L "$home/bin/ucx_info" "$dir/libucx/bin/"
    # The wheel's vendored CUDA runtime, where libucm_cuda's rpath
    # ($ORIGIN/../../../libucx_cu12.libs) looks for it.
    if [ -d "$home/../libucx_cu12.libs" ]; then
        cp -rL "$home/../libucx_cu12.libs" "$dir/"
    fi
    echo "prepared $dir ($(du -sh "$dir" | cut -f1))"
}

run() {
    local dir
    dir="$(cd "$1" && pwd)" || fail "no prepared directory $1"
    [ -x "$dir/gpu_check" ] || fail "$dir holds no gpu_check: run --prepare first"
    export LD_LIBRARY_PATH="$dir/libucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export UCX_MODULE_DIR="$dir/libucx/lib/ucx"
    echo "== GPUs"
    nvidia-smi -L 2>/dev/null || echo "(nvidia-smi not found)"
    echo "== UCX"
    if [ -x "$dir/libucx/bin/ucx_info" ]; then
        "$dir/libucx/bin/ucx_info" -v | head -n 3
        "$dir/libucx/bin/ucx_info" -d 2>/dev/null | grep -E "Transport: cuda|Memory domain: cuda" | sort -u ||
            echo "(this UCX lists no CUDA transports)"
    fi
    echo "== typed-error tests (tests/gpu.rs)"
    timeout 120 "$dir/gpu_test" --test-threads=1
    local tests=$?
    echo "== device memory through UCX (examples/gpu_check.rs)"
    local log
    log=$(mktemp)
    timeout 180 "$dir/gpu_check" "${CHECK_ARGS[@]}" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    local why
    why=$(grep -E "FAILED|^unavailable|panicked" "$log" | head -n 1)
    rm -f "$log"
    [ "$tests" -eq 0 ] || fail "tests/gpu.rs exit $tests"
    case "$rc" in
    0) echo "GPU CHECK: PASS" ;;
    3) fail "no GPU or no CUDA-enabled UCX: $why" ;;
    124) fail "gpu_check ran past 180 s: $why" ;;
    *) fail "gpu_check exit $rc: $why" ;;
    esac
}

CHECK_ARGS=()
case "${1:-}" in
--prepare)
    [ $# -ge 2 ] || fail "usage: $0 --prepare DIR"
    prepare "$2"
    ;;
--run)
    [ $# -ge 2 ] || fail "usage: $0 --run DIR [gpu_check args]"
    dir="$2"
    shift 2
    CHECK_ARGS=("$@")
    run "$dir"
    ;;
*)
    CHECK_ARGS=("$@")
    prepare "${CARGO_TARGET_DIR:-$PWD/target/gpu}/check"
    run "${CARGO_TARGET_DIR:-$PWD/target/gpu}/check"
    ;;
esac
