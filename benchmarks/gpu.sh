#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one command: every CUDA test (pytest -m cuda), then the GPU tables
# (the pool engines serial, fused and streams against m = 1..16 at batch 16 and 32 on ResNet-20 and
# ResNet-50; BSP against DDP over NCCL; the allreduce of a CUDA buffer over NCCL, staged MPI and CUDA-aware
# MPI), appended to benchmarks/results/gpu.md. Run it whenever a CUDA GPU is at hand:
#
#     benchmarks/gpu.sh                          # the python on PATH
#     PYTHON=.venv/bin/python benchmarks/gpu.sh  # a virtual environment's
#
# Without a CUDA device the tests skip, one line says the tables need one, nothing is written and the exit
# status is 0. Every step has a time limit, and all of them together GPU_SH_SECONDS (default 480: 8 minutes
# on one GPU); a step that fails or runs out of time gets a note in gpu.md instead of its table. The exit
# status is non-zero when a CUDA test failed or a step did not finish.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python}
BUDGET=${GPU_SH_SECONDS:-480}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

limit_for() { # limit_for CAP: CAP seconds, or what is left of the budget if less (0: nothing left)
    local left=$((BUDGET - SECONDS - 5))
    if ((left < 20)); then echo 0; elif ((left < $1)); then echo "$left"; else echo "$1"; fi
}

echo "== gpu.sh: CUDA tests"
summary=$(mktemp)
trap 'rm -f "$summary"' EXIT
tests_rc=0
timeout --kill-after=10 150 "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda tests \
    | tee "$summary" || tests_rc=$?
tests_line=$(grep -E '(passed|skipped|failed|error|deselected)' "$summary" | tail -n 1 || true)
echo "== gpu.sh: CUDA tests ended with exit status $tests_rc: $tests_line"

cuda=$("$PYTHON" -m benchmarks.gpu cuda) # a Python that cannot answer stops the script here
if [[ $cuda != 1 ]]; then
    echo "gpu.sh: the GPU tables need a CUDA device (torch.cuda.is_available() is False): not measured, nothing written"
    exit "$tests_rc"
fi

MPICROSSBOW_BENCH_COMMAND="benchmarks/gpu.sh" \
    "$PYTHON" -m benchmarks.gpu header --tests "$tests_line" --tests-rc "$tests_rc"

failed=0
step() { # step NAME CAP COMMAND...: run COMMAND under its time limit; a note in gpu.md if it does not finish
    local name=$1 limit rc=0 start=$SECONDS
    limit=$(limit_for "$2")
    shift 2
    if ((limit == 0)); then
        echo "== gpu.sh: $name not started: the budget of $BUDGET s is spent"
        rc=124
    else
        echo "== gpu.sh: $name (at most $limit s)"
        timeout --kill-after=10 "$limit" "$@" || rc=$?
        echo "== gpu.sh: $name ended with exit status $rc after $((SECONDS - start)) s"
    fi
    if ((rc != 0)); then
        failed=1
        "$PYTHON" -m benchmarks.gpu note --step "$name" --rc "$rc" --limit "$limit"
    fi
}

POOL=(-m benchmarks.pool --device cuda --engines serial,fused,streams --learners 1,2,4,8,16 --batches 16,32
    --rounds 3 --round-seconds 0.25 --out gpu)
step "pool, ResNet-20" 120 "$PYTHON" "${POOL[@]}" --models resnet20
step "pool, ResNet-50" 180 "$PYTHON" "${POOL[@]}" --models resnet50
step "BSP vs DDP-NCCL" 90 "$PYTHON" -m benchmarks.ddp --device cuda --ranks 2 --models resnet20,vgg16 \
    --rounds 2 --out gpu
step "exchange over CUDA" 60 "$PYTHON" -m benchmarks.exchange --device cuda --ranks 2 --sizes 16K,1M,16M,100M \
    --repeats 20 --min-repeats 5 --out gpu

echo "== gpu.sh: done in $SECONDS s; appended to benchmarks/results/gpu.md"
if ((tests_rc != 0)); then exit "$tests_rc"; fi
exit "$failed"
