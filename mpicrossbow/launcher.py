"""``crossbow-launch``: parse the cfg, start the MPI job if needed, build the session on every rank, train.

Failure policy — no rank is ever left hanging:

* bad input (cfg, CLI, model file, data file) is found before any rank communicates; ranks agree on it with
  one ``allgather``, rank 0 prints one line, every rank exits with status 2;
* any exception later, on any rank, prints one line naming the rank and the cause (the traceback goes to
  ``rank<r>.traceback`` in the run folder) and calls ``MPI_Abort``, which ends every rank of the job.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from .config import Config, load_config
from .devices import device_for_rank
from .env import World, detect_launcher, detect_world, launcher_rank
from .errors import USAGE_EXIT_CODE, UsageError
from .log import setup_logging
from .numa import MODES, bind, device_label, gather_facts, report

log = logging.getLogger("mpicrossbow.launcher")  # also when run as __main__

#: Seconds between printing a rank's failure and MPI_Abort: MPI launchers forward output through pipes and
#: may drop what is still in flight when they kill the job.
ABORT_GRACE_S = 0.2

EPILOG = """\
overrides: section.key=value sets a key of a section, KEY=value a bare key, e.g.
  crossbow-launch -cfg session.cfg optim.lr=0.05 session.epochs=3 RULE=BSP
Run under mpirun/mpiexec/srun, every rank trains; run alone, it starts one rank per DEVICES entry."""


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (Theano-MPI's ``-cfg`` spelling, ``--cfg`` and ``-cfg=FILE`` too)."""
    parser = argparse.ArgumentParser(
        prog="crossbow-launch",
        description="Train a model with an mpicrossbow session.cfg.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-cfg", "--cfg", required=True, metavar="FILE", help="the session.cfg to run")
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
    return parser


def _say(message: str) -> None:
    sys.stderr.write(f"crossbow-launch: error: {message}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``crossbow-launch``; returns the exit status."""
    args = build_parser().parse_args(argv)
    setup_logging()
    overrides = [*args.overrides, *([f"checkpoint.resume={args.resume}"] if args.resume else [])]
    if args.bind is not None:
        overrides.append(f"numa.bind={args.bind}")
    try:
        config = load_config(args.cfg, overrides)
    except UsageError as exc:  # every rank reads the same cfg and fails alike: rank 0 speaks for all
        if detect_launcher() is None or launcher_rank() in (0, None):
            _say(str(exc))
        return USAGE_EXIT_CODE
    if args.np is not None and args.np < 1:
        _say(f"-np must be at least 1, got {args.np}")
        return USAGE_EXIT_CODE
    if args.print_config:
        sys.stdout.write(config.to_ini())
        return 0
    if detect_launcher() is None:
        from .spawn import spawn

        try:
            return spawn(
                config.devices,
                ["-cfg", args.cfg, *overrides],
                args.np,
                hostfile=args.hostfile,
                bind=config.numa.bind,
                launcher=args.launcher,
            )
        except UsageError as exc:
            _say(str(exc))
            return USAGE_EXIT_CODE
    if args.hostfile and launcher_rank() in (0, None):
        log.warning("-hostfile is used only when crossbow-launch starts the job itself; ignored under MPI")
    return run_rank(config)


def run_rank(config: Config, rule: Any = None) -> int:
    """This rank's whole life: agree on set-up, train, and abort the job on any failure."""
    from .session import Session

    world = detect_world()
    setup_logging(world.rank, world.size, config.session.log_level.upper() if world.rank == 0 else None)
    session = Session(config, world, rule)
    code = bind_and_prepare(world, session) or agree(world, session.check_consistency)
    if code:
        return code
    try:
        session.prepare_collective()
        result = session.run()
        session.close()
    except BaseException as exc:
        abort(world, exc, session.run_dir)
    if world.rank == 0:
        log.info(
            "done: %d epoch(s), %d step(s), val accuracy %.4f, %.1f s (exchange %.1f s), results in %s",
            result.epochs,
            result.steps,
            result.val_accuracy,
            result.wall_seconds,
            result.exchange_seconds,
            result.run_dir,
        )
    return 0


def bind_and_prepare(world: World, session: Any) -> int:
    """Bind this rank's cores (before CUDA starts), prepare the session locally, agree, report bindings.

    Returns 0 when every rank is ready, else the exit status :func:`agree` chose.
    """
    config = session.config
    try:
        label = device_label(device_for_rank(config.devices, world.rank, world.size))
    except UsageError:  # reported by prepare_local on every rank, through agree
        label = "?"
    facts = gather_facts(world, label)

    def prepare() -> None:
        session.binding = bind(config.numa.bind, facts, world.rank, config.numa.memory)
        session.prepare_local()

    code = agree(world, prepare)
    if code == 0 and config.numa.report:
        report(world, session.binding)
    return code


def agree(world: World, prepare: Any) -> int:
    """Run ``prepare`` (no communication inside), then agree across ranks whether it worked.

    Returns 0 on success everywhere; otherwise rank 0 prints each distinct problem once and every rank
    returns 2 (bad input) or 1 (a crash).
    """
    problem: tuple[str, str] | None = None
    try:
        prepare()
    except UsageError as exc:
        problem = ("usage", str(exc))
    except Exception as exc:  # a crash while reading the user's files is still reported, not hung on
        problem = ("crash", f"{type(exc).__name__}: {exc} ({_where(exc)})")
    problems = world.mpi.allgather(problem) if world.mpi is not None else [problem]
    failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
    if not failed:
        return 0
    if world.rank == 0:
        seen: dict[str, list[int]] = {}
        for rank, (_, text) in failed:
            seen.setdefault(text, []).append(rank)
        for text, ranks in seen.items():
            everyone = len(ranks) == world.size
            _say(text if everyone else f"rank {','.join(map(str, ranks))}: {text}")
    return USAGE_EXIT_CODE if all(kind == "usage" for _, (kind, _) in failed) else 1


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "no traceback"
    last = frames[-1]
    return f"{Path(last.filename).name}:{last.lineno} in {last.name}"


def abort(world: World, exc: BaseException, run_dir: Path | None) -> NoReturn:
    """Print one line naming this rank and the cause, keep the traceback in a file, abort every rank."""
    if isinstance(exc, KeyboardInterrupt):
        text, code = "interrupted", 130
    elif isinstance(exc, UsageError):
        text, code = str(exc), USAGE_EXIT_CODE
    elif exc.__traceback__ is None:  # reported, never raised (the watchdog's stall): the message says it all
        text, code = str(exc), 1
    else:
        text, code = f"{type(exc).__name__}: {exc} ({_where(exc)})", 1
    detail = ""
    if run_dir is not None and exc.__traceback__ is not None and not isinstance(exc, KeyboardInterrupt):
        try:
            path = run_dir / f"rank{world.rank}.traceback"
            path.write_text("".join(traceback.format_exception(exc)), encoding="utf-8")
            detail = f"; traceback in {path}"
        except OSError:
            pass
    _say(f"rank {world.rank} of {world.size} on {world.hostname} failed: {text}{detail}")
    if world.mpi is not None and world.size > 1:
        time.sleep(ABORT_GRACE_S)  # let the launcher forward the line before MPI_Abort tears the job down
        world.mpi.Abort(code)
    sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())
