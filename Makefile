# The front door: `make demo` and `make test`. Each installs what is missing
# first (Debian/Ubuntu), then builds and runs.

SHELL := /bin/bash
CARGO ?= cargo
PKGS := libucx-dev libhwloc-dev libudev-dev libclang-dev pkg-config
# For tests only: promtool (package prometheus) validates the metrics text.
TEST_PKGS := prometheus
# Engine tests drive busy-poll threads: keep them from starving a 2-core box.
TEST_THREADS ?= 2

.PHONY: deps test-deps demo test loom bench fmt clippy

deps:
	@./scripts/deps.sh $(PKGS)

demo: deps
	$(CARGO) run --release -p kvpoll-cli --bin kvpoll -- demo

test-deps:
	@./scripts/deps.sh $(PKGS) --test $(TEST_PKGS)

test: test-deps
	TEST_THREADS=$(TEST_THREADS) ./scripts/test.sh

# loom explores every interleaving of the bitmap-and-publish protocol. It uses
# its own target dir so that the `--cfg loom` build does not evict the normal one.
loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom $(CARGO) test --release --lib --tests loom -- --test-threads=1

# The benches live beside the tool (kvpoll-cli/benches); e2e spawns its peer
# processes from the release binary.
bench: deps
	$(CARGO) build --release -p kvpoll-cli --bin kvpoll
	$(CARGO) bench -p kvpoll-cli

fmt:
	$(CARGO) fmt --all

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy --workspace --all-targets --features cuda -- -D warnings
