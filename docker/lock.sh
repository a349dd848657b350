#!/usr/bin/env bash
# Regenerate docker/constraints.txt and docker/constraints-cuda.txt: the exact versions the
# images install. Run it after changing dependencies in pyproject.toml, review the diff, and
# rebuild. It resolves with pip's dry run (metadata only: nothing large is downloaded) for
# the images' Python versions on manylinux x86_64, then checks that every pin also has a
# wheel for aarch64.
#
#   docker/lock.sh                # uses .venv/bin/python (needs pip >= 23)
#   PYTHON=python3 docker/lock.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
PIP_PIN=${PIP_PIN:-pip==26.3}           # the pip the images upgrade to before installing
CPU_PY=3.11                             # python:3.11-slim-trixie (docker/Dockerfile)
CUDA_PY=3.12                            # Ubuntu 24.04's python3.12 (docker/Dockerfile.cuda)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The direct requirements: the project's own dependencies and its [server] extra, read from
# pyproject.toml so this list cannot drift from it.
"$PYTHON" - "$tmp/reqs.txt" <<'EOF'
import sys, tomllib
meta = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = list(meta["dependencies"]) + list(meta["optional-dependencies"]["server"])
open(sys.argv[1], "w").write("\n".join(reqs + ["setuptools"]) + "\n")
EOF

platforms() {  # $1: arch
    for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_28 manylinux_2_27 \
               manylinux_2_17 manylinux2014 linux; do
        printf -- '--platform %s_%s ' "$tag" "$1"
    done
}

lock() {  # $1: python version, $2: output file, $3: header, $4...: extra requirements
    local py=$1 out=$2 header=$3
    shift 3
    # shellcheck disable=SC2046
    "$PYTHON" -m pip install --dry-run --ignore-installed --quiet --only-binary=:all: \
        --python-version "$py" $(platforms x86_64) --target "$tmp/t" \
        --report "$tmp/report.json" -r "$tmp/reqs.txt" "$@"
    "$PYTHON" - "$tmp/report.json" "$out" "$header" "$PIP_PIN" <<'EOF'
import json, sys
report, out, header, pip_pin = sys.argv[1:]
rows = sorted(
    (i["metadata"]["name"].lower().replace("_", "-"), i["metadata"]["version"])
    for i in json.load(open(report))["install"]
)
with open(out, "w") as f:
    f.write(header.rstrip("\n") + "\n" + pip_pin + "\n")
    f.writelines(f"{name}=={version}\n" for name, version in rows)
EOF
    # Every pin must also exist for aarch64.
    grep -v -e '^#' -e '^pip==' "$out" > "$tmp/pins.txt"
    # shellcheck disable=SC2046
    "$PYTHON" -m pip install --dry-run --ignore-installed --quiet --no-deps --only-binary=:all: \
        --python-version "$py" $(platforms aarch64) --target "$tmp/t" -r "$tmp/pins.txt"
    echo "wrote $out"
}

lock "$CPU_PY" docker/constraints.txt \
"# Pinned versions for docker/Dockerfile (CPU image, Python 3.11, Linux x86_64/aarch64).
# Covers the [server] extra and its dependencies, plus pip and the build backend.
# Regenerate with docker/lock.sh after changing pyproject.toml; review the diff."

lock "$CUDA_PY" docker/constraints-cuda.txt \
"# Pinned versions for docker/Dockerfile.cuda (Ubuntu 24.04's Python 3.12, Linux x86_64/aarch64).
# Covers the [server] extra, jax[cuda12] (the CUDA 12 PJRT plugin and NVIDIA's CUDA/cuDNN/NCCL
# wheels), pip and the build backend. Regenerate with docker/lock.sh; review the diff." \
    'jax[cuda12]'
