#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one command, in the order of what a short loan of a GPU should give
# first (issue 49's priority): (a) every CUDA test (pytest -m cuda); then the GPU tables, appended to
# benchmarks/results/gpu.md: (b) train: one short training run per engine on the GPU (the digits job and the
# MNIST-1D CNN, serial, fused and streams) with its final accuracy next to the same cfg's on this machine's
# CPU, and BSP on 2 ranks sharing the GPU through the staged MPI exchange; (c) exchange: the allreduce of a
# CUDA buffer over staged MPI, CUDA-aware MPI and NCCL against the floor of a pinned copy off the device and
# back; (d) graphs and streams: the pool engines with CUDA graphs against without; (e) tta: the showdown on
# one GPU, MNIST-1D to 94 %; (f) resnet50: the pool engines on ResNet-50. Steps that are not in the default
# list, by name: learners (the engines against m = 1..16 on ResNet-20 without graphs), precision (bf16
# against fp32 without graphs), ddp (BSP against DDP over NCCL: needs one GPU per rank). Run it whenever a
# CUDA GPU is at hand (benchmarks/gpu_device.sh runs it on a lent machine):
#
#     benchmarks/gpu.sh                          # the python on PATH
#     PYTHON=.venv/bin/python benchmarks/gpu.sh  # a virtual environment's
#     GPU_SH_STEPS=graphs,streams,tta,resnet50 benchmarks/gpu.sh   # only these steps (a second try)
#
# The steps' names for GPU_SH_STEPS (default: tests,train,exchange,graphs,streams,tta,resnet50; also
# learners, precision, ddp). Without a CUDA device the tests skip, one line says the tables need one, nothing
# is written and the exit status is 0. Every step has a time limit (passed to it as GPU_SH_STEP_SECONDS), and
# all of them together GPU_SH_SECONDS (default 400); a step that fails or runs out of time gets a note in
# gpu.md instead of its table, so every step writes its section even when it fails. The exit status is
# non-zero when a CUDA test failed or a step did not finish.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python}
BUDGET=${GPU_SH_SECONDS:-400}
STEPS=${GPU_SH_STEPS:-tests,train,exchange,graphs,streams,tta,resnet50}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

limit_for() { # limit_for CAP: CAP seconds, or what is left of the budget if less (0: nothing left)
    local left=$((BUDGET - SECONDS - 5))
    if ((left < 20)); then echo 0; elif ((left < $1)); then echo "$left"; else echo "$1"; fi
}

wants() { [[ ",$STEPS," == *",$1,"* ]]; } # wants NAME: whether GPU_SH_STEPS names the step

tests_rc=0
tests_limit=$(limit_for 90)
if ! wants tests; then
    tests_line="not run (GPU_SH_STEPS=$STEPS)"
elif ((tests_limit == 0)); then # timeout 0 would mean no limit at all
    tests_rc=124
    tests_line="not started: the budget of $BUDGET s is spent"
    echo "== gpu.sh: CUDA tests $tests_line"
else
    echo "== gpu.sh: CUDA tests (at most $tests_limit s)"
    summary=$(mktemp)
    trap 'rm -f "$summary"' EXIT
    timeout --kill-after=10 "$tests_limit" "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda tests \
        | tee "$summary" || tests_rc=$?
    tests_line=$(grep -E '(passed|skipped|failed|error|deselected)' "$summary" | tail -n 1 || true)
    echo "== gpu.sh: CUDA tests ended with exit status $tests_rc: $tests_line"
fi

cuda=$("$PYTHON" -m benchmarks.gpu cuda) # a Python that cannot answer stops the script here
if [[ $cuda != 1 ]]; then
    echo "gpu.sh: the GPU tables need a CUDA device (torch.cuda.is_available() is False): not measured, nothing written"
    exit "$tests_rc"
fi

MPICROSSBOW_BENCH_COMMAND="benchmarks/gpu.sh" \
    "$PYTHON" -m benchmarks.gpu header --tests "$tests_line" --tests-rc "$tests_rc"

failed=0
step() { # step KEY NAME CAP COMMAND...: run COMMAND under its time limit (unless GPU_SH_STEPS leaves KEY
    # out); a note in gpu.md if it does not finish
    local name=$2 limit rc=0 start=$SECONDS
    if ! wants "$1"; then
        echo "== gpu.sh: $name left out (GPU_SH_STEPS=$STEPS)"
        return
    fi
    limit=$(limit_for "$3")
    shift 3
    if ((limit == 0)); then
        echo "== gpu.sh: $name not started: the budget of $BUDGET s is spent"
        rc=124
    else
        echo "== gpu.sh: $name (at most $limit s)"
        GPU_SH_STEP_SECONDS=$limit timeout --kill-after=10 "$limit" "$@" || rc=$?
        echo "== gpu.sh: $name ended with exit status $rc after $((SECONDS - start)) s"
    fi
    if ((rc != 0)); then
        failed=1
        "$PYTHON" -m benchmarks.gpu note --step "$name" --rc "$rc" --limit "$limit"
    fi
}

POOL=(-m benchmarks.pool --device cuda --engines serial,fused,streams --learners 1,2,4,8,16 --batches 16,32
    --rounds 3 --round-seconds 0.25 --out gpu)
PRECISION=(-m benchmarks.pool --device cuda --engines serial,fused --precisions fp32,bf16 --learners 1,8
    --batches 32 --rounds 3 --round-seconds 0.25 --out gpu)
step train "training runs per engine" 150 "$PYTHON" -m benchmarks.gpu_train --device cuda \
    --engines serial,fused,streams --cfgs launch/digits.cfg,launch/mnist1d.cfg --bsp-staged --run-timeout 40 \
    --out gpu
step exchange "exchange over CUDA" 60 "$PYTHON" -m benchmarks.exchange --device cuda --ranks 2 \
    --sizes 16K,1M,16M,100M --repeats 20 --min-repeats 5 --out gpu
GRAPHS=(-m benchmarks.pool --device cuda --graphs off,on --models resnet20 --batches 16 --rounds 3
    --round-seconds 0.2 --out gpu)
step graphs "CUDA graphs, ResNet-20" 30 "$PYTHON" "${GRAPHS[@]}" --engines fused --learners 2,4,8,16
step graphs "bf16 vs fp32 with CUDA graphs, ResNet-50" 30 "$PYTHON" -m benchmarks.pool --device cuda \
    --engines fused --precisions fp32,bf16 --graphs on --models resnet50 --learners 8 --batches 32 --rounds 3 \
    --round-seconds 0.2 --out gpu
step streams "streams with CUDA graphs, ResNet-20" 40 "$PYTHON" "${GRAPHS[@]}" --engines serial,streams \
    --learners 8
step learners "learners per GPU, ResNet-20" 120 "$PYTHON" "${POOL[@]}" --models resnet20
step precision "bf16 vs fp32, ResNet-20" 60 "$PYTHON" "${PRECISION[@]}" --models resnet20
step precision "bf16 vs fp32, ResNet-50" 90 "$PYTHON" "${PRECISION[@]}" --models resnet50
step ddp "BSP vs DDP-NCCL" 90 "$PYTHON" -m benchmarks.ddp --device cuda --ranks 2 --models resnet20,vgg16 \
    --rounds 2 --out gpu
step tta "showdown on one GPU, MNIST-1D to 94 %" 90 "$PYTHON" -m benchmarks.tta --device cuda --out gpu
step resnet50 "pool, ResNet-50" 120 "$PYTHON" "${POOL[@]}" --models resnet50

echo "== gpu.sh: done in $SECONDS s; appended to benchmarks/results/gpu.md"
if ((tests_rc != 0)); then exit "$tests_rc"; fi
exit "$failed"
