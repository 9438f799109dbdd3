#!/usr/bin/env bash
# torchtitan's fault-tolerant trainer on one GPU against a local 3-node cluster (issue 31, item 5).
#
# Two replica groups of torchtitan 0.3.0's FT trainer (--module torchft.llama3 --config
# llama3_torchft_debugmodel --fault_tolerance.enable), one rank each, both ranks on the one GPU
# (each group's own process group is NCCL on cuda:0; across the groups Gloo,
# --fault_tolerance.process_group gloo: NCCL refuses two ranks of one communicator on one device),
# against a local 3-node cluster; in each run a SIGKILL of the Raft leader while Quorum calls wait
# at it, then a SIGKILL of replica group 1 (torchrun and its rank) and its restart (it heals from
# the survivor and trains on). The run is `python -m benchmarks torchtitan --restart` (its module
# docstring has the phases and figures); this script installs what the GPU image lacks, checks the
# device, runs it and prints ONE verdict line:
#
#   GPU torchtitan: PASS (<systems>; <device>; <seconds> s)
#   GPU torchtitan: FAIL <why>
#
# PASS: every run went through every phase, no step failed at the leader kill, the survivor
# committed again after the group kill, and the restarted group healed and committed steps.
#
#   scripts/gpu_torchtitan.sh wheels     # here, with network: scripts/gpu_tests.sh's wheels plus
#                                        # torchtitan, torchft 0.2.0 and what they import that the
#                                        # GPU image lacks, as Python 3.12 x86-64 wheels in .whl/
#   scripts/gpu_torchtitan.sh            # on the GPU machine (device tool: carry `.whl`)
#   scripts/gpu_torchtitan.sh --dry-run  # install and check everything, print the plan; no training
#   GPU_TORCHTITAN_DEVICE=cpu scripts/gpu_torchtitan.sh   # the same run on CPU, CUDA hidden (any machine)
#
# Settings (environment): GPU_TORCHTITAN_SYSTEMS, default ftclient-cluster-per-step,torchft-cluster
# (ftclient per-step, the asynchronous quorum; torchft 0.2.0 in DiLoCo mode, the mode in which its
# heals work with two groups); GPU_TORCHTITAN_STEPS "warmup,steady,after", default 3,5,3;
# GPU_TORCHTITAN_TIMEOUT seconds for the whole run, default 540. Results: $OUT (the device tool's)
# or /tmp/gpu-torchtitan-out: gpu-torchtitan.{json,md,log} and the trainers' and nodes' logs
# (gpu-torchtitan-logs.tar.gz).
#
# On the GPU the trainer still runs through examples/torchtitan/cpu_shim.py, whose patches only add
# what is missing: with CUDA present its device, triton and FSDP-reduction patches do nothing;
# torch.distributed.set_timeout is added only where torch lacks it (torch 2.11 to 2.13 do); its
# FlexAttention patch runs FlexAttention eagerly instead of through torch.compile (slower, the
# same results; the debug model is small).
set -uo pipefail
cd "$(dirname "$0")/.."

PREFIX="GPU torchtitan"
MODE=run
case "${1:-}" in
  wheels) MODE=wheels ;;
  --dry-run) MODE=dry ;;
  "") ;;
  *) echo "usage: $0 [wheels|--dry-run]" >&2; exit 2 ;;
esac

# What torchtitan's FT trainer imports at run time (traced on CPU: the modules loaded by a run of
# the trainer) that the GPU image lacks, pinned to the versions this checkout is tested with.
EXTRA_WHEELS=(torchtitan==0.3.0 torchft==0.2.0 spmd_types==0.2.3 torchdata==0.11.0 datasets==4.7.0
              dill==0.4.0 multiprocess==0.70.18 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1
              wcwidth==0.7.0)

if [ "$MODE" = wheels ]; then
  set -e
  bash scripts/gpu_tests.sh wheels >/dev/null
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${EXTRA_WHEELS[@]}"
  ls .whl
  du -sh .whl
  exit 0
fi

OUT_DIR=${OUT:-/tmp/gpu-torchtitan-out}
mkdir -p "$OUT_DIR"
DEVICE=${GPU_TORCHTITAN_DEVICE:-cuda}
SYSTEMS=${GPU_TORCHTITAN_SYSTEMS:-ftclient-cluster-per-step,torchft-cluster}
IFS=, read -r WARMUP STEADY AFTER <<<"${GPU_TORCHTITAN_STEPS:-3,5,3}"
LIMIT=${GPU_TORCHTITAN_TIMEOUT:-540}
WORK=$(mktemp -d /tmp/gpu-torchtitan.XXXXXX)

verdict_printed=0
verdict() {  # the one verdict line
  echo "$PREFIX: $*"
  verdict_printed=1
}
finish() {
  local rc=$?
  [ "$verdict_printed" = 1 ] || echo "$PREFIX: FAIL (the script stopped with status $rc before a verdict)"
  rm -rf "$WORK"
}
trap finish EXIT

# The project's dependencies and the trainer's, where missing (a development machine has them).
if ! python3 -c "import grpc, tenacity, pysyncobj, msgpack, torchtitan, torchft, datasets, tyro" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || { verdict "FAIL (installing .whl/*.whl failed)"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/site/bin:$PATH  # torchft_lighthouse, if a run asks for it
  fi
fi
# The node and trainer processes import this checkout too.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

if [ "$DEVICE" = cpu ]; then
  BENCH_DEVICE=cpu
  export CUDA_VISIBLE_DEVICES=""
else
  BENCH_DEVICE=auto
  nvidia-smi -L 2>/dev/null || true
fi

# Preflight: imports, versions, the device, and what the shim would patch here.
if ! PREFLIGHT=$(DEVICE=$DEVICE python3 - 2>&1 <<'EOF'
import importlib.util, os, sys
import torch
import torch.distributed as dist
problems = []
had_set_timeout = hasattr(dist, "set_timeout")
for mod in ("torchtitan", "torchft", "ftclient", "lighthouse_cluster", "datasets", "tyro", "tokenizers"):
    try:
        __import__(mod)
    except Exception as e:  # noqa: BLE001
        problems.append(f"import {mod}: {type(e).__name__}: {e}")
if not problems:  # the trainer's own modules, as the trainer imports them (after the shim's patches)
    try:
        import importlib
        sys.path.insert(0, "examples/torchtitan")
        import cpu_shim
        cpu_shim.install()
        importlib.import_module("torchtitan.train")
        importlib.import_module("torchtitan.experiments.torchft.llama3")
    except Exception as e:  # noqa: BLE001
        problems.append(f"torchtitan's trainer does not import with this torch: {type(e).__name__}: {e}")
cuda = torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if cuda else "cpu"
print(f"torch {torch.__version__}, cuda available: {cuda}, device: {name}, "
      f"triton: {importlib.util.find_spec('triton') is not None}, "
      f"dist.set_timeout: {had_set_timeout} (the shim adds it when missing)")
try:
    from importlib.metadata import version
    print("torchtitan", version("torchtitan"), "torchft", version("torchft"))
except Exception as e:  # noqa: BLE001
    problems.append(f"versions: {e}")
if os.environ["DEVICE"] != "cpu" and not cuda:
    problems.append("CUDA is not available")
if os.environ["DEVICE"] == "cpu" and cuda:
    problems.append("CUDA_VISIBLE_DEVICES='' did not hide CUDA")
if problems:
    print("PROBLEMS: " + "; ".join(problems))
    sys.exit(1)
EOF
); then
  echo "$PREFLIGHT"
  verdict "FAIL ($(echo "$PREFLIGHT" | grep -o 'PROBLEMS: .*' | sed 's/^PROBLEMS: //' | head -c 600))"
  exit 1
fi
echo "$PREFLIGHT"

CMD=(python3 -m benchmarks torchtitan --systems "$SYSTEMS" --restart --device "$BENCH_DEVICE"
     --warmup-steps "$WARMUP" --steady-steps "$STEADY" --after-steps "$AFTER"
     --out "$OUT_DIR" --name gpu-torchtitan --workdir "$WORK/run" --verdict "torchtitan run")
echo "plan: ${CMD[*]} (limit ${LIMIT} s, device $DEVICE)"
if [ "$MODE" = dry ]; then
  python3 -m benchmarks torchtitan --help >/dev/null || { verdict "FAIL (python -m benchmarks torchtitan does not start)"; exit 1; }
  verdict "DRY-RUN ok (preflight passed; nothing trained; device $DEVICE; systems $SYSTEMS)"
  exit 0
fi

# The run's own verdict line (prefix "torchtitan run") goes to the log only: the one printed is ours.
timeout -k 10 "$LIMIT" "${CMD[@]}" 2>&1 | tee "$OUT_DIR/gpu-torchtitan.log" | grep -av '^torchtitan run: '
rc=${PIPESTATUS[0]}
tar -czf "$OUT_DIR/gpu-torchtitan-logs.tar.gz" -C "$WORK" --exclude=run/tests --exclude="*/dump-g*" run 2>/dev/null || true
line=$(grep -a '^torchtitan run: ' "$OUT_DIR/gpu-torchtitan.log" | tail -1)
if [ -n "$line" ]; then
  verdict "${line#torchtitan run: }"
  [ "$rc" = 0 ] && exit 0 || exit 1
elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  verdict "FAIL (the run did not finish within ${LIMIT} s; logs in $OUT_DIR)"
else
  verdict "FAIL (the run exited with $rc without a verdict: $(tail -3 "$OUT_DIR/gpu-torchtitan.log" | tr '\n' ' ' | head -c 600))"
fi
exit 1
