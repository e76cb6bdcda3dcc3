#!/usr/bin/env bash
# Train the GDN hybrid LM (gdn,gdn,gdn,attn, hidden 1024, 8 heads of 128) on 65536-token
# MQAR sequences on a multi-GPU machine, with and without context parallelism, and tabulate
# the runs:
#
#   bash scripts/gpu_train_runs.sh OUT_DIR
#
#   cpN     --mesh data=1,seq=N --batch 1   one sequence split over N GPUs (CP), e.g. cp4
#   single  --mesh data=1,seq=1 --batch 1   the whole sequence on one GPU (no CP)
#   dpN     --mesh data=N,seq=1 --batch N   one sequence per GPU (data parallel, no CP)
#
# Each run writes into OUT_DIR/<name>/ (stdout.log, train.log with stderr); a failed run (out
# of memory, say) does not stop the others. Then benchmarks.bench.train writes a record of
# every run directory in OUT_DIR into $REPORT (default docs/benchmarks/train.json) and renders
# its table beside it (train.md). The exit status is 1 if a run failed. Environment:
#   RUNS="cp4 single dp4"   the runs to do, in order
#   BACKEND=pallas          --backend for the GDN layers (default: the library's)
#   EXTRA="..."             train.py flags appended to each run (the last of a flag wins), e.g.
#                           EXTRA="--seq-len 256 --hidden 64 --heads 2 --head-dim 32 --steps 3
#                           --vocab 64 --pairs 4"
#   RUN_TIMEOUT=900         seconds per run (default: none)
#   PYTHON=.venv/bin/python
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/gpu_train_runs.sh OUT_DIR}
py=${PYTHON:-.venv/bin/python}
report=${REPORT:-docs/benchmarks/train.json}
export XLA_PYTHON_CLIENT_PREALLOCATE=false

# MQAR with 2048 pairs (keys in the first 4096 tokens, queries from token 32768): 2048
# supervised tokens per sequence, recalled across devices under CP; lr 1e-3 for this width
common=(--layers gdn,gdn,gdn,attn --hidden 1024 --heads 8 --head-dim 128 --seq-len 65536
        --vocab 8192 --pairs 2048 --lr 1e-3 --warmup 10 --dtype bfloat16 --steps 30
        --eval-every 10 --ckpt-every 0)
if [ -n "${BACKEND:-}" ]; then common+=(--backend "$BACKEND"); fi
read -r -a extra <<< "${EXTRA:-}"

first_gpu=${CUDA_VISIBLE_DEVICES:-0}
first_gpu=${first_gpu%%,*}
failed=0
run() {  # run NAME TRAIN_FLAGS...
  local name=$1 dir=$out/$1
  shift
  mkdir -p "$dir"
  echo "== $name" >&2
  if timeout "${RUN_TIMEOUT:-0}" "$py" scripts/train.py "${common[@]}" "$@" \
      ${extra[@]+"${extra[@]}"} --run-dir "$dir" >"$dir/stdout.log" 2>"$dir/train.log"; then
    tail -n 1 "$dir/stdout.log" >&2
  else
    echo "$name failed (exit $?): $(tail -n 1 "$dir/train.log")" >&2
    failed=1
  fi
}

for name in ${RUNS:-cp4 single dp4}; do
  if [[ $name =~ ^cp[0-9]+$ ]]; then
    run "$name" --mesh "data=1,seq=${name#cp}" --batch 1
  elif [[ $name =~ ^dp[0-9]+$ ]]; then
    run "$name" --mesh "data=${name#dp},seq=1" --batch "${name#dp}"
  elif [[ $name == single ]]; then
    CUDA_VISIBLE_DEVICES=$first_gpu run single --mesh data=1,seq=1 --batch 1
  else
    echo "unknown run $name (cpN, single, dpN)" >&2; exit 2
  fi
done

"$py" -m benchmarks.bench.train "$out"/*/ --json "$report" || failed=1
exit $failed
