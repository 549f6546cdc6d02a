"""``crossbow-launch``: parse the command line and the cfg, then start the MPI job (run alone) or train
this rank (run under ``mpiexec``/``srun``).

The path to ``mpiexec`` imports nothing heavy (no torch, no MPI library): a rank imports those itself. The
failure protocol every rank follows is :mod:`mpicrossbow.launch.failure`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .config import Config, load_config
from .errors import USAGE_EXIT_CODE, UsageError
from .launch.binding import MODES
from .launch.collector import collector_off_then_frozen, freeze_objects_at_exit
from .launch.failure import say
from .launch.slurm import srun_tasks_without_pmi
from .launch.world import detect_launcher, launcher_rank
from .log import LAUNCHER_TAG, setup_logging

log = logging.getLogger("mpicrossbow.cli")  # also when run as __main__

EPILOG = """\
overrides: section.key=value sets a key of a section, KEY=value a bare key, e.g.
  crossbow-launch -cfg session.cfg optim.lr=0.05 session.epochs=3 RULE=BSP
Run under mpirun/mpiexec/srun, every rank trains; run alone, it starts one rank per DEVICES entry.
crossbow-launch --clean-shm (no -cfg) removes what failed MPICH jobs left in /dev/shm."""


def rules_line() -> str:
    """The rules RULE= accepts, for ``--help`` (importing them imports torch: only help pays for it)."""
    from .rules.registry import RULES

    return f"RULE= one of {', '.join(RULES)}, or module:Class for your own (docs/rules.md)."


def build_parser(rules: bool = False) -> argparse.ArgumentParser:
    """The command-line interface (Theano-MPI's ``-cfg`` spelling, ``--cfg`` and ``-cfg=FILE`` too);
    ``rules``: the help names every rule."""
    parser = argparse.ArgumentParser(
        prog="crossbow-launch",
        description="Train a model with an mpicrossbow session.cfg.",
        epilog=f"{rules_line()}\n{EPILOG}" if rules else EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-cfg", "--cfg", metavar="FILE", help="the session.cfg to run (required to train)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="cfg overrides")
    parser.add_argument(
        "-np",
        "--np",
        type=int,
        metavar="N",
        help="ranks to start when run without an MPI launcher (default: one per DEVICES entry; "
        "for DEVICES=cpu one per usable core)",
    )
    parser.add_argument(
        "-resume",
        "--resume",
        nargs="?",
        const="latest",
        metavar="PATH",
        help="resume from the newest checkpoint of this cfg's runs, or from PATH (a checkpoint or run "
        "folder): the same as checkpoint.resume=...",
    )
    parser.add_argument(
        "-bind",
        "--bind",
        choices=MODES,
        metavar="MODE",
        help="core binding per rank: none, core, numa, socket or gpu (same as numa.bind=MODE)",
    )
    parser.add_argument(
        "-hostfile",
        "--hostfile",
        metavar="FILE",
        help="hosts to start ranks on when run without an MPI launcher ('host slots=N' or 'host:N' lines)",
    )
    parser.add_argument(
        "-launcher",
        "--launcher",
        choices=("auto", "mpiexec", "srun"),
        default="auto",
        help="how to start the job when run alone (auto: srun inside a Slurm allocation, else mpiexec)",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved cfg and exit")
    parser.add_argument(
        "--clean-shm",
        action="store_true",
        help="remove this user's MPI (MPICH and Open MPI) shared-memory segments in /dev/shm that no live "
        "process uses (what failed jobs started by mpiexec/srun leave), print what was removed and exit; "
        "takes no -cfg",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``crossbow-launch``; returns the exit status."""
    given = sys.argv[1:] if argv is None else argv
    parser = build_parser(rules=any(a in ("-h", "--help") for a in given))
    args = parser.parse_args(argv)
    setup_logging(tag=LAUNCHER_TAG)  # not a rank yet: the rank tags its lines once MPI is up
    if args.clean_shm:
        if args.cfg is not None or args.overrides or args.resume:
            parser.error("--clean-shm starts no job: give it without -cfg, overrides or --resume")
        return clean_shm()
    if args.cfg is None:
        parser.error("the following arguments are required: -cfg/--cfg (or --clean-shm alone)")
    overrides = [*args.overrides, *([f"checkpoint.resume={args.resume}"] if args.resume else [])]
    if args.bind is not None:
        overrides.append(f"numa.bind={args.bind}")
    try:
        config = load_config(args.cfg, overrides)
    except UsageError as exc:  # every rank reads the same cfg and fails alike: rank 0 speaks for all
        if detect_launcher() is None or launcher_rank() in (0, None):
            say(str(exc))
        return USAGE_EXIT_CODE
    if args.np is not None and args.np < 1:
        say(f"-np must be at least 1, got {args.np}")
        return USAGE_EXIT_CODE
    if args.print_config:
        try:
            text = resolved(config).to_ini()
        except UsageError as exc:
            say(str(exc))
            return USAGE_EXIT_CODE
        if config.rule.strip().upper() == "AUTO":
            return print_auto_config(config, text)
        sys.stdout.write(text)
        return 0
    if detect_launcher() is None and srun_tasks_without_pmi():
        return no_pmi()
    if detect_launcher() is None:
        from .launch.spawn import spawn

        try:
            return spawn(
                config.devices,
                ["-cfg", args.cfg, *overrides],
                args.np or config.size,
                hostfile=args.hostfile,
                bind=config.numa.bind,
                launcher=args.launcher,
                fault_tolerant=config.elastic.enabled is not False,
            )
        except UsageError as exc:
            say(str(exc))
            return USAGE_EXIT_CODE
    if args.hostfile and launcher_rank() in (0, None):
        log.warning("-hostfile is used only when crossbow-launch starts the job itself; ignored under MPI")
    freeze_objects_at_exit()
    with collector_off_then_frozen():
        from .training.run.runner import run_rank  # ranks import torch; the path to mpiexec does not

        try:  # every [rule] key is checked here, before MPI starts, as [optim]'s are when the cfg is read
            resolved(config)
        except UsageError as exc:  # every rank reads the same cfg and fails alike: rank 0 speaks for all
            if launcher_rank() in (0, None):
                say(str(exc))
            return USAGE_EXIT_CODE

    return run_rank(config)


def clean_shm() -> int:
    """``--clean-shm``: remove the unused MPI segments of this user, say what went in one line, exit 0."""
    from .launch.shm_hygiene import remove_unused_segments, shm_dir

    folder = shm_dir()
    sys.stdout.write(f"crossbow-launch --clean-shm: {remove_unused_segments(folder).summary(folder)}\n")
    return 0


def no_pmi() -> int:
    """srun started several tasks without a PMI: the first says which ``--mpi`` to use; all exit 2."""
    if launcher_rank() in (0, None):
        from .launch.spawn import no_pmi_advice

        say(no_pmi_advice(srun_tasks_without_pmi()))
    return USAGE_EXIT_CODE


def print_auto_config(config: Config, text: str) -> int:
    """``--print-config`` with ``RULE=AUTO``: the cfg, then as a comment what AUTO would choose. Under MPI
    every rank measures as a run's first window does (:func:`~.training.run.runner.preview_rank`) and rank 0
    prints; started alone, the comment says how to see the choice on N ranks."""
    if detect_launcher() is None:
        sys.stdout.write(
            text + "# RULE = AUTO chooses from the job's own step time and link: start --print-config under "
            "mpiexec -n N to see its choice on N ranks (docs/rules.md, AUTO)\n"
        )
        return 0
    from .training.run.runner import preview_rank

    code, line = preview_rank(config)
    if code == 0 and launcher_rank() in (0, None):
        sys.stdout.write(f"{text}# RULE = AUTO here: {line}\n")
    return code


def resolved(config: Config) -> Config:
    """``config`` with the rule's name and every hyper-parameter resolved (defaults included)."""
    from .rules.registry import resolve  # rules import torch: only --print-config pays for it

    return resolve(config)[1]


if __name__ == "__main__":
    sys.exit(main())
