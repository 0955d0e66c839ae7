# The front door: `make demo` and `make test`. Each installs what is missing
# first (Debian/Ubuntu), then builds and runs.

SHELL := /bin/bash
CARGO ?= cargo
PKGS := libucx-dev libhwloc-dev libudev-dev libclang-dev pkg-config gcc python3 python3-venv
# For tests only: promtool (package prometheus) validates the metrics text;
# ip (iproute2) builds the network namespaces of the partition drills;
# gdb stops a reader inside a shared-memory send in reader_kill.rs.
TEST_PKGS := prometheus iproute2 gdb
# Engine tests drive busy-poll threads: keep them from starving a 2-core box.
TEST_THREADS ?= 2

TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
# What libkvpoll_c.a needs besides itself (`cargo rustc -p kvpoll-c --lib
# --crate-type staticlib -- --print native-static-libs`).
C_STATIC_LIBS := -lucp -luct -lucs -lucm -lhwloc -ludev -lgcc_s -lutil -lrt -lpthread -lm -ldl
C_FLAGS := -std=c11 -Wall -Wextra -Werror -D_POSIX_C_SOURCE=200809L -Ibindings/c

.PHONY: deps test-deps demo test loom bench bench-peers compare fmt clippy c-test header soak sim-soak fuzz fuzz-build wheel wheel-test gpu-check

deps:
	@./scripts/deps.sh $(PKGS)

demo: deps
	$(CARGO) run --release -p kvpoll-cli --bin kvpoll -- demo

test-deps:
	@./scripts/deps.sh $(PKGS) --test $(TEST_PKGS)

test: test-deps
	TEST_THREADS=$(TEST_THREADS) ./scripts/test.sh

# The Python wheel (abi3, CPython >= 3.8) into $(TARGET_DIR)/wheels: built
# against UCX 1.22 from the libucx-cu12 wheel (scripts/ucx-wheel-env.sh),
# which it depends on, with an rpath into that wheel's installed libraries,
# so it needs neither libucx-dev nor Rust where it is installed.
WHEEL_DIR := $(abspath $(TARGET_DIR))/wheels
wheel:
	KVPOLL_UCX_HOME="$$(./scripts/ucx-wheel-env.sh)" KVPOLL_UCX_RPATH='$$ORIGIN/../libucx/lib' \
		CARGO_TARGET_DIR=$(abspath $(TARGET_DIR))/wheel \
		target/ucx122/venv/bin/maturin build --release --compatibility linux \
		-m bindings/python/Cargo.toml -o $(WHEEL_DIR)

# That wheel installed with pip into a fresh virtual environment, the
# README's Python quick start run there, and the libucp it loaded checked
# to be the libucx wheel's.
wheel-test: wheel
	./scripts/wheel-test.sh $(WHEEL_DIR)

# On a machine with an NVIDIA GPU: device memory registered and moved
# through UCX 1.22 (the libucx-cu12 wheel's) by two engines, in one process
# and in two; one PASS/FAIL line. Not part of `make test`.
gpu-check:
	./scripts/gpu-check.sh

# loom explores every interleaving of the bitmap-and-publish protocol. It uses
# its own target dir so that the `--cfg loom` build does not evict the normal one.
loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom $(CARGO) test --release --lib --tests loom -- --test-threads=1

# The criterion benches, measured: the library's (benches/: the ledger, the
# rings, an engine in one process), then the tool's end to end across
# processes (kvpoll-cli/benches/e2e.rs), which spawns its peers from the
# release binary. Both the production build: without the demo's
# fault-injection hooks (`kvpoll bench` says which it ran). `make test`
# runs each bench once, unmeasured.
bench: deps
	$(CARGO) bench -p kvpoll --benches
	$(CARGO) build --release -p kvpoll-cli --no-default-features --bin kvpoll
	$(CARGO) bench -p kvpoll-cli --no-default-features --benches

# The systems `kvpoll bench compare` measures kvpoll against: NIXL (CPU
# only; its wheel bundles its own UCX) and Mooncake Transfer Engine, in a
# venv under the target dir. Not part of `make test`. NIXL's wheel lists
# torch, which its Python API does not import: it is left out.
BENCH_VENV := $(TARGET_DIR)/bench-peers/venv
bench-peers:
	test -x $(BENCH_VENV)/bin/python || python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet numpy mooncake-transfer-engine-non-cuda==0.3.13.post1
	$(BENCH_VENV)/bin/pip install --quiet --no-deps nixl-cu12==1.5.1
	$(BENCH_VENV)/bin/python -c "import nixl_cu12._api, mooncake.engine"

# The whole suite with the comparison, its table and both plots.
compare: deps bench-peers
	$(CARGO) build --release -p kvpoll-cli --no-default-features --bin kvpoll
	$(TARGET_DIR)/release/kvpoll bench --svg docs/bench-cdf.svg

# The C ABI: tests/pull.c linked against libkvpoll_c.so, then libkvpoll_c.a.
c-test:
	$(CARGO) build -p kvpoll-c
	mkdir -p $(TARGET_DIR)/c
	cc $(C_FLAGS) -o $(TARGET_DIR)/c/pull-shared bindings/c/tests/pull.c \
		-L$(TARGET_DIR)/debug -lkvpoll_c -Wl,-rpath,$(abspath $(TARGET_DIR))/debug
	cc $(C_FLAGS) -o $(TARGET_DIR)/c/pull-static bindings/c/tests/pull.c \
		$(TARGET_DIR)/debug/libkvpoll_c.a $(C_STATIC_LIBS)
	$(TARGET_DIR)/c/pull-shared
	$(TARGET_DIR)/c/pull-static

# Regenerates bindings/c/kvpoll.h (cbindgen); `cargo test` fails while the
# checked-in header differs from what this would write.
header:
	KVPOLL_BLESS=1 $(CARGO) test -p kvpoll-c --test header

fmt:
	$(CARGO) fmt --all
	cd bindings/python && $(CARGO) fmt

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy --workspace --all-targets --features cuda -- -D warnings

# The soak: the demo's modes over and over with the full fault mix (kills,
# pauses, stalls, handle, setup and release failures) for SOAK_SECS (30
# minutes), sampling memory, file descriptors and ring occupancy every 5 s
# into target/soak.csv; it fails if any grew without bound, or on anything
# corrupted, leaked, lost or duplicated.
SOAK_SECS ?= 1800
soak: deps
	$(CARGO) build --release -p kvpoll-cli --bin kvpoll
	$(TARGET_DIR)/release/kvpoll demo --soak $(SOAK_SECS) --soak-csv $(TARGET_DIR)/soak.csv

# The protocol core's whole-run proptest over the simulator, at length.
sim-soak:
	KVPOLL_SIM_CASES=$${KVPOLL_SIM_CASES:-200000} $(CARGO) test --release --test core_sim -- --nocapture

# Coverage-guided fuzzing (fuzz/, outside the workspace) with libFuzzer on
# stable Rust: LLVM's sancov pass through stable -C flags, and --target so
# that build scripts are built without it. Each target runs FUZZ_SECONDS on
# a working corpus under the target dir, seeded by fuzz/corpus/<target>;
# a crash stops the run and leaves its input in fuzz/ (crash-*).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := control peer_metadata notification rkey_address core_map
FUZZ_HOST := $(shell rustc -vV | sed -n 's/^host: //p')
FUZZ_DIR := $(abspath $(TARGET_DIR))/fuzz
FUZZ_RUSTFLAGS := -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
	-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
	-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks

fuzz-build:
	cd fuzz && RUSTFLAGS="$(FUZZ_RUSTFLAGS)" CARGO_TARGET_DIR=$(FUZZ_DIR) \
		$(CARGO) build --release --bins --target $(FUZZ_HOST)

fuzz: fuzz-build
	@for t in $(FUZZ_TARGETS); do \
		mkdir -p $(FUZZ_DIR)/corpus/$$t && \
		echo "==> fuzz $$t for $(FUZZ_SECONDS) s" && \
		(cd fuzz && $(FUZZ_DIR)/$(FUZZ_HOST)/release/$$t -max_total_time=$(FUZZ_SECONDS) \
			-print_final_stats=1 $(FUZZ_DIR)/corpus/$$t corpus/$$t) || exit 1; \
	done
