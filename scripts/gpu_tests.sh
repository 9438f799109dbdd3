#!/usr/bin/env bash
# The GPU tests (tests/gpu: ftclient's ProcessGroupNCCL and ProcessGroupBabyNCCL, the Manager's
# CUDA stream handling, the DDP example training on CUDA through a real cluster) on a machine
# with CUDA, from the repository root.
#
#   scripts/gpu_tests.sh wheels   # here, with network: download the project's runtime
#                                 # dependencies as Python 3.12 x86-64 wheels into .whl/
#   scripts/gpu_tests.sh [ARGS]   # on the GPU machine: install .whl/*.whl into /tmp/site
#                                 # (where the dependencies are missing), then
#                                 # python3 -m pytest tests/gpu -q [ARGS]
#
# The GPU machine has torch (CUDA) but not this project's dependencies and no network, so
# they travel as wheels: with the device tool, name `.whl` in `carry` and run
# `bash scripts/gpu_tests.sh` (add `/.whl/` to .git/info/exclude once). Without CUDA the
# tests skip with the reason "CUDA is not available".
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = wheels ]; then
  py=3.12
  platforms=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
             --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
             --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  mkdir -p .whl
  # What `import ftclient` and tests/conftest.py need that the GPU image lacks (or has in
  # another version); pinned to the versions this checkout is tested with.
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    "${platforms[@]}" -d .whl \
    grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
    cryptography==48.0.0 cffi==2.0.0 pycparser==3.0 tenacity==9.2.1 msgpack==1.2.4 \
    prometheus_client==0.26.0 uvloop==0.23.0 click==8.4.0 rich==15.0.0
  # pysyncobj ships only as a source archive: build its (pure Python) wheel here.
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" pysyncobj==0.3.17
  python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "$tmp"/pysyncobj-*.tar.gz
  rm -rf "$tmp"
  ls .whl
  exit 0
fi

# Only where the dependencies are missing (a development machine already has them).
if ! python3 -c "import grpc, tenacity, pysyncobj, msgpack" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The node and trainer processes the tests start import this checkout too.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi -L || true
python3 - <<'EOF'
import torch
print("torch", torch.__version__, "cuda available:", torch.cuda.is_available(),
      "nccl:", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
EOF
# With the device tool, $OUT comes back: the JUnit report lands there.
exec python3 -m pytest tests/gpu -q -p no:cacheprovider ${OUT:+--junitxml "$OUT/gpu-junit.xml"} "$@"
