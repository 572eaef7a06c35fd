#!/usr/bin/env bash
# What to run on a machine with a CUDA GPU (the device tool's lent machine, or any GPU box):
# the tests marked gpu, then the DDP and HSDP examples on CUDA with two replica groups sharing the
# GPU, one of them SIGKILLed mid-run and restarted so it heals live from the other. pytest runs only
# the files that hold gpu tests: the rest of the suite imports test-only packages (h2,
# cryptography) a bare GPU image may not have. Last, the DDP example under `torchheal launch`,
# where the killed group restarts in a warm spare forked from a template that imported torch.
# The step counts keep the survivor training well past the restarted group's cold start (about 12 s
# on the lent H200, where the DDP example runs ~130 steps/s): with fewer, the survivor finished
# first and the restarted group trained alone, healing nothing (seen with 800 and 1200 steps).
#   bash scripts/gpu_check.sh [OUTDIR]
set -uo pipefail
OUT=${1:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
nvidia-smi -L
$PY -c "import torch, grpc, google.protobuf as pb; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None, 'grpc', grpc.__version__, 'protobuf', pb.__version__)"
[ -n "${SKIP_PYTEST:-}" ] || { echo "== pytest -m gpu"; $PY -m pytest -m gpu $(grep -rlE "mark\.gpu|pytestmark.*gpu" tests/ | sort) -q -p no:cacheprovider -rs --timeout 240 2>&1 | tee "$OUT/pytest-gpu.log" | tail -40; }

kill_tree() {  # SIGKILL a process and all its descendants (torchrun starts workers in new sessions)
  local pid=$1 child
  for child in $(pgrep -P "$pid"); do kill_tree "$child"; done
  kill -9 "$pid" 2>/dev/null
}

run_example() {  # name script steps
  local name=$1 script=$2 steps=$3
  echo "== $name: 2 replica groups on one GPU (REPLICA_PG=gloo between groups), group 1 killed and restarted"
  $PY -m torchheal.cli lighthouse --bind 127.0.0.1:29510 --min_replicas 1 --join_timeout_ms 1000 \
      --dashboard_port 0 > "$OUT/$name-lighthouse.log" 2>&1 &
  local lh=$!
  sleep 3
  # The divergence guard (every 100 steps, the default): fingerprints of CUDA state, over Gloo.
  local common="env TORCHHEAL_DIVERGENCE_CHECK_INTERVAL=100 REPLICA_PG=gloo STEPS=$steps NUM_REPLICA_GROUPS=2 TORCHHEAL_LIGHTHOUSE=http://127.0.0.1:29510"
  $common REPLICA_GROUP_ID=0 torchrun --master_port=29600 --nnodes=1 --nproc_per_node=1 "$script" > "$OUT/$name-g0.log" 2>&1 &
  local g0=$!
  $common REPLICA_GROUP_ID=1 torchrun --master_port=29601 --nnodes=1 --nproc_per_node=1 "$script" > "$OUT/$name-g1a.log" 2>&1 &
  local g1=$!
  # Kill once group 1 trains (a logged step past 0), so the kill lands mid-run, not in its start-up.
  for _ in $(seq 120); do grep -qE "step [1-9][0-9]* loss" "$OUT/$name-g1a.log" && break; sleep 0.5; done
  sleep ${KILL_AFTER_S:-2}
  echo "killing group 1 (pid $g1 and every descendant)"; kill_tree $g1
  sleep 2
  $common REPLICA_GROUP_ID=1 torchrun --master_port=29602 --nnodes=1 --nproc_per_node=1 "$script" > "$OUT/$name-g1b.log" 2>&1 &
  local g1b=$!
  wait $g0; echo "group 0 exit $?"; wait $g1b; echo "group 1 (restarted) exit $?"
  kill $lh 2>/dev/null; wait $lh 2>/dev/null
  for f in "$OUT/$name"-g*.log; do
    echo "-- $f"; grep -E "healing to|loaded the recovered|Error|Traceback|diverg" "$f" | grep -v Warning | tail -4
    grep -E "^step|root step" "$f" | sed -n '1p;$p'
  done
}
run_example ddp examples/train_ddp.py ${DDP_STEPS:-6000}
run_example hsdp examples/train_hsdp.py ${HSDP_STEPS:-5000}

echo "== ddp under torchheal launch: 2 groups on one GPU, one killed every 12 s, restarted warm"
env REPLICA_PG=gloo STEPS=${LAUNCH_STEPS:-3000} $PY -m torchheal.cli launch --replicas 2 --kill-every 12s \
    --dashboard-port 0 --deadline 150s -- $PY examples/train_ddp.py > "$OUT/launch.log" 2>&1
echo "launch exit $?"
grep -E "started \(pid|killed|committed after|Traceback|Error" "$OUT/launch.log" | grep -v Warning | tail -12
sed -n '/== torchheal launch summary ==/,$p' "$OUT/launch.log"
