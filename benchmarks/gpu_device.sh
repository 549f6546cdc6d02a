#!/usr/bin/env bash
# What a lent GPU machine runs: the one command line, from the repository root of that machine's copy of
# the working tree, with the carry list [".gpu-carry"] (benchmarks/gpu_carry.sh fills it here first):
#
#     bash benchmarks/gpu_device.sh "$OUT"
#
# (benchmarks/gpu.py: DEVICE_COMMAND, CARRY.) Why: that machine has Python 3.12 with a CUDA build of torch,
# NCCL, h5py and pytest, but no network, no package index and maybe no MPI library; what else the project
# needs comes in .gpu-carry/. What it does, every step logged into OUTDIR:
#
# 1. A virtual environment in a temporary folder, made from the machine's Python (PYTHON, default python3)
#    without pip, which sees every package of that Python through a .pth file (site.addsitedir of each of its
#    site-packages folders: torch, numpy, h5py and pytest stay the machine's own, whether that Python is a
#    base interpreter or itself a virtual environment, where --system-site-packages would show the base's
#    packages instead). Why not install into the machine's Python: pip would overwrite its mpi4py in place
#    (or refuse, PEP 668), and mpi4py finds the MPICH wheel's library in its environment's prefix, lib/,
#    which for a system Python is a system folder. In the venv the carried wheels land in its own
#    site-packages, searched first, so the carried mpi4py shadows a preinstalled one and loads the carried
#    MPICH; MPICH's mpiexec lands in the venv's bin/, first on PATH.
# 2. The carried wheels, with the machine's pip run by the venv's interpreter: `pip install --no-index
#    --no-deps --ignore-installed WHEEL...` (and PIP_NO_INDEX=1): no index is ever asked, no requirement is
#    resolved, so torch is never replaced (its version and location are compared before and after). The
#    fallback wheels (Pillow, tqdm) only where the machine's Python cannot import them. GPU_DEVICE_INSTALL=0
#    skips this step (the tests do); GPU_CARRY_DIR names another carry folder.
# 3. The project importable without installing it: a .pth naming the repository, read before the machine's
#    packages (what an editable install writes, without needing setuptools on that machine), and setup.py's
#    console scripts (crossbow-launch, ...) as small scripts in the venv's bin/.
# 4. The MNIST-1D cache that gpu_carry.sh generated, copied into data/mnist1d/ (the machine may lack the
#    generator's packages). The versions: nvidia-smi, `python -m benchmarks.gpu versions` (torch, CUDA, cuDNN, NCCL, MPI, mpiexec,
#    hwloc, ...), mpiexec --version.
# 5. benchmarks/gpu.sh with GPU_SH_SECONDS = what is left of GPU_DEVICE_SECONDS (default 420 s for this whole
#    script, which leaves time for a second try within a 15-minute loan) less 20 s for copying results back.
#    GPU_SH_STEPS passes through (a second try: GPU_SH_STEPS=ddp,exchange,train,resnet50 bash ...).
# 6. OUTDIR: gpu.md (the sections gpu.sh appended to benchmarks/results/gpu.md, to append to the committed
#    file), device.log (this script's own lines), setup.log, pip.log, nvidia-smi.txt, versions.txt,
#    gpu_sh.log, summary.txt.
#
# A step that fails is logged and the script goes on; summary.txt and the logs are written whatever happens.
# Exit status: gpu.sh's when it is not 0, else 1 when the set-up failed, else 0.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
if [[ $# -ne 1 || -z $1 ]]; then
    echo "usage: benchmarks/gpu_device.sh OUTDIR" >&2
    exit 2
fi
mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
BUDGET=${GPU_DEVICE_SECONDS:-420}
RESERVE=20 # seconds left at the end for the results to be copied back
CARRY=${GPU_CARRY_DIR:-.gpu-carry}
BASE=${PYTHON:-python3}
GPU_MD=benchmarks/results/gpu.md
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_device.XXXXXX")
VENV=$WORK/venv
PY=$BASE
SITE=""
setup_rc=0
gpu_rc="not run"

log() { printf '%s gpu_device.sh [%ds] %s\n' "$(date +%H:%M:%S)" "$SECONDS" "$*" | tee -a "$OUTDIR/device.log"; }
fail() { setup_rc=1; log "FAILED: $*"; }

finish() { # finish STATUS: summary.txt, whatever ended the script
    local setup="ok"
    ((setup_rc == 0)) || setup="FAILED (see device.log, setup.log, pip.log)"
    {
        echo "exit status: $1"
        echo "budget: $BUDGET s (GPU_DEVICE_SECONDS); elapsed: $SECONDS s"
        echo "set-up: $setup"
        echo "gpu.sh exit status: $gpu_rc"
        echo "files: $(cd "$OUTDIR" && ls | grep -vx summary.txt | tr '\n' ' ')summary.txt"
    } >"$OUTDIR/summary.txt"
    rm -rf "$WORK"
}
trap 'finish $?' EXIT

make_venv() { # a venv without pip that sees the machine Python's packages after its own
    timeout 60 "$BASE" -m venv --without-pip "$VENV" >>"$OUTDIR/setup.log" 2>&1 || return 1
    SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    "$BASE" - >"$SITE/_gpu_device_parent.pth" <<'EOF' || return 1
import os, site
dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
for d in dict.fromkeys(dirs):
    if os.path.isdir(d):
        print(f"import site; site.addsitedir({d!r})")
EOF
    cat "$SITE/_gpu_device_parent.pth" >>"$OUTDIR/setup.log"
}

torch_where() { # torch's version and location as PYTHON $1 finds it, without importing it (seconds saved)
    "$1" -c 'import importlib.metadata as m, importlib.util as u; print(m.version("torch"), u.find_spec("torch").origin)' \
        2>&1 | tail -n 1 || true
}

install_wheels() { # the carried wheels into the venv; the fallbacks only where the import fails
    local wheel dist module picked=()
    shopt -s nullglob
    for wheel in "$CARRY"/*.whl; do
        dist=${wheel##*/}
        dist=${dist%%-*}
        case ${dist,,} in
            pillow) module=PIL ;;
            tqdm) module=tqdm ;;
            *) module="" ;;
        esac
        if [[ -n $module ]] && "$PY" -c "import $module" >/dev/null 2>&1; then
            log "$dist: the machine's Python imports $module; its carried wheel is left out"
            continue
        fi
        picked+=("$wheel")
    done
    shopt -u nullglob
    if ((${#picked[@]} == 0)); then
        fail "no wheels in $CARRY (run benchmarks/gpu_carry.sh where there is network, and carry it)"
        return
    fi
    local pip=("$PY" -m pip install --no-index --no-deps --ignore-installed --no-cache-dir)
    log "${pip[*]} ${picked[*]##*/}"
    if timeout 180 "${pip[@]}" "${picked[@]}" >>"$OUTDIR/pip.log" 2>&1; then
        log "installed (pip.log)"
    else
        fail "pip install of the carried wheels (pip.log: $(tail -n 1 "$OUTDIR/pip.log"))"
    fi
}

console_scripts() { # setup.py's console scripts as small scripts in the venv's bin/
    "$PY" - "$VENV/bin" <<'EOF'
import re, sys
from pathlib import Path

for name, module, func in re.findall(r'"([\w-]+) = ([\w.]+):(\w+)"', Path("setup.py").read_text()):
    script = Path(sys.argv[1]) / name
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
    script.chmod(0o755)
    print(script)
EOF
}

log "budget $BUDGET s; the machine's Python: $BASE; carry: $CARRY; results: $OUTDIR"
ls -l "$CARRY" >>"$OUTDIR/setup.log" 2>&1 || true
torch_before=$(torch_where "$BASE")
log "torch of the machine's Python: $torch_before"

if make_venv; then
    PY=$VENV/bin/python
    export PATH="$VENV/bin:$PATH"
    log "virtual environment $VENV over the machine's packages (setup.log)"
else
    fail "no virtual environment from $BASE (setup.log); going on with it directly, without the carry"
    PY=$BASE
    SITE=""
fi

if [[ ${GPU_DEVICE_INSTALL:-1} == 0 ]]; then
    log "install of the carried wheels skipped (GPU_DEVICE_INSTALL=0)"
elif [[ -z $SITE ]]; then
    log "install of the carried wheels skipped: no virtual environment"
elif [[ ! -d $CARRY ]]; then
    fail "no carry folder $CARRY (run benchmarks/gpu_carry.sh where there is network, and carry it)"
else
    install_wheels
fi

torch_after=$(torch_where "$PY")
if [[ $torch_after != "$torch_before" ]]; then
    fail "torch changed: $torch_before -> $torch_after"
fi

if [[ -n $SITE ]]; then
    printf '%s\n' "$REPO" >"$SITE/_gpu_device_0_repo.pth"
    console_scripts >>"$OUTDIR/setup.log" 2>&1 || fail "console scripts (setup.log)"
else
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
if (cd "$WORK" && "$PY" -c 'import mpicrossbow.cli, benchmarks.gpu') >>"$OUTDIR/setup.log" 2>&1; then
    log "the project imports from any folder"
else
    fail "the project does not import (setup.log)"
fi

timeout 30 nvidia-smi >"$OUTDIR/nvidia-smi.txt" 2>&1 || log "nvidia-smi failed or is missing (nvidia-smi.txt)"
{
    timeout 90 "$PY" -m benchmarks.gpu versions 2>&1 || echo "benchmarks.gpu versions failed"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "mpiexec --version:"
    { timeout 20 mpiexec --version 2>&1 || echo "no mpiexec"; } | head -n 5
} >"$OUTDIR/versions.txt"
tee -a "$OUTDIR/device.log" <"$OUTDIR/versions.txt"

shopt -s nullglob
cached=("$CARRY"/mnist1d/mnist1d-*.h5)
shopt -u nullglob
if ((${#cached[@]})); then # the MNIST-1D data set, generated where the generator installs (gpu_carry.sh)
    mkdir -p data/mnist1d && cp -n "${cached[@]}" data/mnist1d/ && log "MNIST-1D cache into data/mnist1d/: ${cached[*]##*/}"
else
    log "no MNIST-1D cache in $CARRY/mnist1d: the MNIST-1D runs need the mnist1d package on this machine"
fi

before=$(stat -c %s "$GPU_MD" 2>/dev/null || echo 0)
left=$((BUDGET - SECONDS - RESERVE))
if ((left < 30)); then
    log "gpu.sh not started: $left s left of the budget"
    gpu_rc=124
else
    log "benchmarks/gpu.sh with GPU_SH_SECONDS=$left (gpu_sh.log)"
    set +e
    GPU_SH_SECONDS=$left PYTHON=$PY timeout --kill-after=10 $((left + 15)) bash benchmarks/gpu.sh 2>&1 |
        tee "$OUTDIR/gpu_sh.log"
    gpu_rc=${PIPESTATUS[0]}
    set -e
    log "gpu.sh ended with exit status $gpu_rc"
fi
after=$(stat -c %s "$GPU_MD" 2>/dev/null || echo 0)
if ((after > before)); then
    tail -c +$((before + 1)) "$GPU_MD" >"$OUTDIR/gpu.md"
    log "gpu.md: the $((after - before)) bytes gpu.sh appended to $GPU_MD"
else
    log "gpu.sh appended nothing to $GPU_MD: no gpu.md"
fi
if [[ $gpu_rc != 0 ]]; then exit "$gpu_rc"; fi
exit "$setup_rc"
