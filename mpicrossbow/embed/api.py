"""The embedded API: a rule inside your own training loop, in a few added lines.

    import mpicrossbow as xb

    world = xb.init()                                           # the MPI world: world.rank, .size, .device
    loader = xb.shard(train_set, batch_size=64, seed=1)         # this rank's share, new order per epoch
    model, optimizer = xb.distribute(model, optimizer, rule="SMA")
    for epoch in range(epochs):
        for x, y in loader:                                     # your loop, unchanged
            optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
        with xb.consensus(model):                               # the rule's model, for validation or saving
            validate(model)
    if xb.finish():                                             # drain; every model holds the consensus
        torch.save(model.state_dict(), "model.pt")              # rank 0 writes it once

One process-wide state holds the world (``init``) and the current job (``distribute`` to ``finish``); a
finished job may be followed by another ``distribute``. ``init`` comes first and explicitly, as ``hvd.init()``
and ``init_process_group`` do: ``shard``, ``distribute``, ``finish`` and the rest before it are a UsageError
that says so, and a second ``init`` that would change the first one's arguments is one too (MPI, the device
and the binding are chosen once per process), never silently ignored.

Failures follow ``crossbow-launch``'s protocol: bad input found before the ranks talk is one line from rank 0
and the same exit status everywhere; an exception on any rank later ends the whole job with one line naming
the rank (the traceback goes to a file the line names); a rank that leaves the script with its job
unfinished ends the job instead of leaving peers waiting.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import math
import os
import secrets
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ..comm import make_communicator
from ..comm.base import Communicator
from ..config.fields import build
from ..config.sections import CommSection, ElasticSection, NumaSection, SessionSection
from ..data.loader import LoaderOptions
from ..dynamo_on_demand import spare_dynamo
from ..errors import USAGE_EXIT_CODE, ConfigError, UsageError
from ..launch.binding import bind as bind_cores
from ..launch.binding import gather_facts
from ..launch.devices import device_for_rank, parse_devices
from ..launch.failure import abort, abort_job, agree, leave_job, say
from ..launch.finalize_fence import bound_finalize
from ..launch.slurm import srun_tasks_without_pmi
from ..launch.spawn import no_pmi_advice
from ..launch.world import World, detect_world, launcher_rank, mpi_threads_ok
from ..log import setup_logging
from ..model.consistency import check_same_shapes
from ..pool.base import params_loaded
from ..pool.precision import DTYPES, Precision
from ..rules.base import Rule
from ..rules.lr_recipe import uncapped_scaling
from ..rules.registry import build_rule
from ..training.run.schedule import lr_scale
from ..training.run.window import StepWindow, Unguarded
from ..training.tuning.noise_scale import NoiseScale
from .elastic_mode import (
    ModelState,
    check_keepable,
    check_rule,
    elastic_section,
    join_rule,
    join_world,
    replacing,
    tolerant,
)
from .embedded_job import EmbeddedJob
from .loop_position import LoopPosition
from .metric_reduce import allreduce_value, reduce_over
from .own_model import OwnModel
from .precision_forward import PrecisionForward
from .sharded_loader import Part, ShardedLoader

log = logging.getLogger(__name__)

#: How the embedded API's failure lines start.
PREFIX = "mpicrossbow: error: "
#: Where a gradient noise scale that cannot be estimated shows (the embedded API writes no metrics.h5).
NOISE_UNKNOWN = "xb.noise_scale() returns NaN"


@dataclass
class _Process:
    """What this process knows: its world, the communicator settings, its loaders and the current job."""

    world: World | None = None
    #: The arguments of the ``init`` call that made ``world`` (a later ``init`` may not change them).
    init_args: dict[str, Any] = field(default_factory=dict)
    comm: CommSection = field(default_factory=CommSection)
    job: EmbeddedJob | None = None
    part: Part | None = None
    loaders: weakref.WeakSet[ShardedLoader] = field(default_factory=weakref.WeakSet)
    tracebacks: Path | None = None
    #: An uncaught exception is ending the job: the exit hook has nothing to add.
    failed: bool = False
    #: A duplicate of COMM_WORLD for the API's own agreements and ``allreduce``, apart from the rules'.
    control: Any = None
    #: The ranks that train under the current job (None on a rank that serves): ``allreduce``'s group.
    trainers: Any = None
    #: ``xb.init(elastic=...)``'s settings when the job goes on after a lost rank, else None.
    elastic: ElasticSection | None = None
    #: What ``xb.keep`` was given: restored with the model when a lost rank drops a window.
    kept: list[Any] = field(default_factory=list)
    #: Where the loop stands (``xb.epochs``, the training loaders): what a replacement is told.
    loop: LoopPosition = field(default_factory=LoopPosition)
    #: A replacement (``xb.init(elastic={"replace": True})``): the survivors' offer until it joined their job.
    joining: Any = None
    #: A replacement: the states of the ``xb.keep`` objects the survivors handed over, loaded as the script
    #: gives the objects to ``xb.keep`` (in its order).
    handed: list[Any] = field(default_factory=list)


_state = _Process()


def init(
    devices: str | None = None,
    *,
    bind: str = "none",
    comm: Mapping[str, Any] | None = None,
    log_level: str = "info",
    threads: bool = False,
    elastic: bool | str | Mapping[str, Any] = False,
) -> World:
    """Join the MPI world (mpiexec, srun, or a plain single process) and pick this rank's device.

    ``devices`` is a DEVICES list (``cuda0,cuda1``, ``cpu``; one entry per rank, or ``cpu`` for all); by
    default rank r drives CUDA device ``local_rank % count`` when CUDA exists (made the current device, so
    ``torch.device("cuda")`` means it), else the CPU. ``bind`` pins the rank's threads as ``[numa] bind``
    does (``none``, ``core``, ``numa``, ``socket``, ``gpu``); ``comm`` holds ``[comm]`` keys (backend,
    compression, ...). ``threads`` starts MPI with ``MPI_THREAD_MULTIPLE``, which a rule that talks MPI from
    a second thread needs (parameter servers with ``placement=colocated``). ``elastic=True`` (or a dict of
    ``[elastic]`` keys: ``min_ranks``, ``commit_every``, ``replace``) makes the job go on when a rank is
    lost, under Open MPI with ULFM (``mpiexec --with-ft ulfm``), or stops it in one line where that is
    missing; ``replace`` starts a new rank for each one lost, which runs this script and joins the others
    (write the epoch loop with :func:`epochs`); ``elastic="auto"`` is elastic where it can be, else says why
    not and goes on without: see :mod:`.elastic_mode`. Bad arguments end every rank
    with one line naming the argument (``xb.init(devices='gpu0'): unknown device ...``) and status 2.
    Collective.

    Call it first, once, on every rank: :func:`shard`, :func:`distribute` and :func:`finish` before it are a
    UsageError. Called again, it returns the same World when it asks for nothing new (the same arguments, or
    arguments left at their defaults: ``xb.init()`` fetches the world anywhere); an argument that differs
    from the first call's is a UsageError, since MPI, the device and the binding are chosen once per process.

    Returns this rank's :class:`~mpicrossbow.launch.world.World`: ``rank`` and ``size`` (in COMM_WORLD),
    ``local_rank`` and ``local_size`` (on this node), ``node`` and ``nodes``, ``hostname``, ``launcher``
    (``mpich``, ``openmpi``, ``slurm-pmi2``, ... or None in a plain process), ``device`` (the ``torch.device``
    chosen above) and ``mpi`` (mpi4py's COMM_WORLD), so ``if xb.init().rank == 0: ...`` needs no mpi4py.
    """
    asked = {"devices": devices, "bind": bind, "comm": dict(comm or {}), "log_level": log_level}
    asked["threads"] = threads
    asked["elastic"] = dict(elastic) if isinstance(elastic, Mapping) else elastic
    if _state.world is not None:
        problem = _repeated_init_problem(asked)
        if problem:
            _refuse_repeated_init(_state.world, problem)
        return _state.world
    spare_dynamo()  # optimizers built from here on import the compiler only if the script compiles
    if replacing():  # a replacement spawned by an elastic job's survivors: it joins them
        return _join_init(asked)
    world = _start_world(threads, elastic, log_level)
    chosen: dict[str, Any] = {}

    def prepare() -> None:
        try:
            chosen["comm"] = build(CommSection, asked["comm"], "comm")
        except ConfigError as exc:
            raise UsageError(f"xb.init(comm=...): {exc}") from None
        try:
            chosen["numa"] = build(NumaSection, {"bind": bind}, "numa")
        except ConfigError as exc:
            raise _as_argument(exc, "[numa] bind", "bind", bind) from None
        chosen["device"] = choose_device(devices, world)
        chosen["elastic"] = elastic_section(elastic, world)

    _agree(world, prepare)
    device = chosen["device"]
    facts = gather_facts(world, f"cuda{device.index}" if device.type == "cuda" else "cpu")  # DEVICES' form
    _agree(world, lambda: bind_cores(chosen["numa"].bind, facts, world.rank))  # before CUDA starts
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _state.comm = chosen["comm"]
    _state.tracebacks = Path(tempfile.gettempdir()) / f"mpicrossbow-{world.bcast(secrets.token_hex(4))}"
    _state.world = replace(world, device=device)
    _state.init_args = asked
    _state.control = world.mpi.Dup() if world.mpi is not None else None
    _state.elastic = chosen["elastic"]
    if _state.elastic is not None:
        _start_elastic(_state.elastic)
    log.info("%d rank(s); rank 0 on %s, %d thread(s)", world.size, device, torch.get_num_threads())
    return _state.world


def _start_world(threads: bool, elastic: bool | str | Mapping[str, Any], log_level: str) -> World:
    """MPI started (``MPI_THREAD_MULTIPLE`` with ``threads``, or where elastic ``replace`` spawns from a
    thread), the log lines and the failure hooks set; tasks of srun without PMI end here, said once."""
    tasks = srun_tasks_without_pmi()
    if tasks:  # every task would see a world of one and train alone
        if launcher_rank() in (0, None):
            say(no_pmi_advice(tasks), PREFIX)
        raise SystemExit(USAGE_EXIT_CODE)
    replaces = isinstance(elastic, Mapping) and bool(elastic.get("replace"))
    world = detect_world(threads or replaces)
    setup_logging(world.rank, world.size, log_level.upper() if world.rank == 0 else None)
    _install_failure_hooks()
    return world


def _join_init(asked: dict[str, Any]) -> World:
    """``init`` on a replacement (``xb.init(elastic={"replace": True})``'s survivors spawned it to run this
    script): merged with the survivors and told where their loop stands (:func:`.elastic_mode.join_world`),
    its arguments checked here alone (the survivors checked theirs at start; a failure ends only this
    process, as :func:`~mpicrossbow.launch.failure.leave_job` does). It binds no cores. Its collectives
    with the survivors follow in ``xb.distribute``."""
    world, offer = join_world()
    setup_logging(world.rank, world.size, None)
    _install_failure_hooks()
    try:
        _state.comm = build(CommSection, asked["comm"], "comm")
        device = choose_device(asked["devices"], world)
        section = elastic_section(asked["elastic"], world)
        assert section is not None and section.replace, "a replacement of an elastic job with replace"
    except BaseException as exc:
        leave_job(world, exc, None, PREFIX)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _state.tracebacks = Path(offer.run_dir)
    _state.world = replace(world, device=device)
    _state.init_args, _state.elastic, _state.joining = asked, section, offer
    _state.loop.joining = dict(offer.position)
    _start_elastic(section)
    return _state.world


def _start_elastic(section: ElasticSection) -> None:
    """``xb.init(elastic=...)`` is on: MPI_Finalize bounded at exit (a dead rank must not hold it up), and
    one line saying so."""
    atexit.register(bound_finalize)  # before mpi4py's MPI_Finalize, which runs after it
    log.info(
        "elastic: a lost rank is dropped and the others go on (BSP's survivors redo the step over "
        "themselves, SMA's and LOCALSGD's heal from a peer; other rules commit every %d step(s); at least "
        "%d rank(s))",
        section.commit_every,
        section.min_ranks,
    )


#: Seconds a rank whose second ``xb.init`` asks for something new waits for every rank to have done the same
#: (then rank 0 alone says so); past it, the others are elsewhere and this rank ends the job with its line.
REPEATED_INIT_WAIT_S = 5.0


def _repeated_init_problem(asked: dict[str, Any]) -> str | None:
    """A second ``init`` may ask for nothing new; the line refusing one that would change the first call's
    arguments (MPI, the device and the binding are chosen once per process), or None."""
    defaults = {name: p.default for name, p in inspect.signature(init).parameters.items()}
    defaults["comm"] = {}
    first = _state.init_args
    changed = [k for k, value in asked.items() if value != defaults[k] and value != first.get(k, defaults[k])]
    if not changed:
        return None
    now = ", ".join(f"{k}={asked[k]!r}" for k in changed)
    before = ", ".join(f"{k}={first.get(k, defaults[k])!r}" for k in changed)
    return (
        f"xb.init({now}): xb.init already ran in this process with {before}, and MPI, the device and the "
        "binding are chosen once: pass every argument to the first xb.init call (xb.init() without "
        "arguments returns the same world)"
    )


def _refuse_repeated_init(world: World, problem: str) -> None:
    """End the job over a second ``init`` that asks for something new: one line, status 2, nothing left.

    The script makes the same call on every rank, so the ranks meet (a non-blocking allgather on the API's
    own communicator, never the user's): rank 0 says the line, and every rank leaves through a normal exit
    (MPI_Finalize: no shared-memory segment, no traceback folder left). A rank whose peers do not come within
    :data:`REPEATED_INIT_WAIT_S` (a call made on some ranks only) says the line itself and ends the job.
    """
    _state.failed = True  # the exit hook has nothing to add
    control = _state.control
    if control is None or world.size == 1:
        say(problem, PREFIX)
        raise SystemExit(USAGE_EXIT_CODE)
    mine, everyone = bytearray(b"\x01"), bytearray(world.size)
    request = control.Iallgather(mine, everyone)
    deadline = time.monotonic() + REPEATED_INIT_WAIT_S
    while not request.Test():
        if time.monotonic() > deadline:
            abort_job(world, f"rank {world.rank}: {problem}", USAGE_EXIT_CODE, prefix=PREFIX)
        time.sleep(0.01)
    if world.rank == 0:
        say(problem, PREFIX)
    raise SystemExit(USAGE_EXIT_CODE)


def _as_argument(exc: ConfigError, key: str, name: str, value: object) -> UsageError:
    """``exc``, a check worded for the cfg key ``key``, reworded for the argument ``name=value`` the user
    passed: ``xb.init`` reads no cfg, so ``DEVICES: unknown device 'gpu0'`` would name a key nobody wrote."""
    text = str(exc)
    if text.startswith(key):
        text = f"xb.init({name}={value!r})" + text[len(key) :]
    return UsageError(text.replace(f"{key}=", f"{name}="))


def choose_device(devices: str | None, world: World) -> torch.device:
    """``devices``' entry for this rank, or CUDA device ``local_rank % count`` (the CPU without CUDA).

    A bad ``devices`` is a UsageError naming the argument (``xb.init(devices='gpu0'): unknown device ...``),
    not the ``DEVICES`` key of crossbow-launch's cfg whose checks it reuses."""
    if devices:
        try:
            return device_for_rank(parse_devices(devices), world.rank, world.size).torch_device()
        except ConfigError as exc:
            raise _as_argument(exc, "DEVICES", "devices", devices) from None
    if torch.cuda.is_available():
        return torch.device("cuda", world.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def shard(
    dataset: Any,
    batch_size: int,
    seed: int = 0,
    *,
    evaluation: bool = False,
    workers: int = 0,
    prefetch: int = 2,
) -> ShardedLoader:
    """A DataLoader of this rank's equal share of map-style ``dataset``, in a new order every epoch.

    The same pipeline as ``crossbow-launch`` (same data, batch size and seed: the same batches); ``workers``
    processes load ``prefetch`` batches ahead. Iterate it once per epoch; a rank the rule keeps out of
    training (a parameter server) gets no batches. Full batches only: the last partial batch of a share is
    left out (another one each epoch), so every rank takes the same number of steps; a share smaller than
    one batch is an error here, when the loader is built.

    ``evaluation=True``: an evaluation set's loader instead: every sample once, in order, near-equal shares
    (nothing dropped, nothing padded), the last batch short. ``loader.samples`` is the rank's own count, to
    weigh a mean over ranks by (:func:`allreduce`). See :mod:`.sharded_loader`.
    """
    world = _world("xb.shard")
    options = LoaderOptions(workers=workers, prefetch=prefetch, pin_memory=world.device.type == "cuda")
    size = world.size if _state.joining is None else int(_state.joining.position["parts"])
    loader = ShardedLoader(dataset, batch_size, seed, _current_part, options, evaluation, size)
    _state.loaders.add(loader)
    _state.loop.add(loader)
    return loader


def epochs(*bounds: int) -> Iterator[int]:
    """``range(*bounds)``, for the loop's epochs: ``for epoch in xb.epochs(1, epochs + 1):``.

    Where elastic training replaces a lost rank (``xb.init(elastic={"replace": True})``), the replacement
    runs your script from its top, and this loop is how it goes on at the survivors' epoch (a plain
    ``range`` would start it at the first; the survivors then go on without replacements, saying why);
    elsewhere it is ``range``. Local (:mod:`.loop_position`)."""
    _world("xb.epochs")
    try:
        range(*bounds)
    except TypeError as exc:
        raise UsageError(f"xb.epochs{bounds}: takes range()'s arguments, whole numbers ({exc})") from None
    return _state.loop.epochs(bounds)


def _current_part() -> Part:
    """The part the current rule gives this rank (``rank`` of ``size`` before any ``distribute``)."""
    if _state.part is not None:
        return _state.part
    world = _world("a loader of xb.shard")
    return Part(world.rank, world.size)


def distribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rule: str | Rule = "BSP",
    *,
    precision: str = "fp32",
    noise_scale_every: int = SessionSection.noise_scale_every,
    lr_scaling: str = "none",
    lr_cap: float = 0.0,
    **hyper: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Put ``model`` and ``optimizer`` under ``rule`` and return them.

    ``rule`` is a registry name with its ``[rule]`` keys as keywords (``rule="EASGD", mode="async"``), the
    same as one string for a command line (``"EASGD mode=async tau=4"``), or a Rule instance.

    Every rank starts from rank 0's weights and rank 0's optimizer state (its ``state_dict``: momentum
    buffers and every param group's settings; Horovod's ``broadcast_parameters`` and
    ``broadcast_optimizer_state`` in one). Afterwards ``optimizer.step()`` runs the rule's exchange where
    the rule needs it (gradient averaging before the update, model averaging or elastic pulls after it,
    asynchronous messages without waiting). On a rank the rule keeps out of training (parameter servers:
    ranks 0..S-1; the asynchronous EASGD centre: rank 0) this call serves until every worker has called
    :func:`finish`, and returns the final model. Collective.

    ``precision`` (``[optim] precision``'s choices): ``bf16`` or ``fp16`` runs the model's forward under
    autocast and hands its floating outputs back as float32 (weights, gradients, optimizer and rule state
    stay fp32); ``fp16`` also needs :class:`~.grad_scaler.GradScaler` around the step, so every rank skips
    an overflowed step together (:mod:`.precision_forward`).

    ``noise_scale_every`` (``[session] noise_scale_every``): measure the gradient noise scale every N
    optimizer steps (0: never); :func:`noise_scale` reads it.

    ``lr_scaling``, ``lr_cap`` (``[optim]``'s keys): every param group's ``lr`` times 1 (``none``), √k
    (``sqrt``) or k (``linear``), k the ranks that train, at most ``lr_cap`` (0: no cap). ``linear`` is
    Horovod's ``lr * hvd.size()`` for BSP; model averaging wants it with a cap (docs/rules.md). Build a
    learning-rate scheduler after this call, so that it starts from the scaled rate.
    """
    world = _world("xb.distribute")
    if _state.job is not None and not _state.job.finished:
        raise UsageError("xb.distribute: a model is already distributed; call xb.finish() before another")
    if _state.joining is not None:
        return _join_distribute(model, optimizer, rule, precision, noise_scale_every, hyper)
    built: dict[str, Any] = {}

    def prepare() -> None:
        _check_settings(precision, noise_scale_every, lr_scaling, lr_cap)
        chosen = _make_rule(rule, hyper)
        _check_rule(chosen, lr_scaling, lr_cap, precision)
        chosen.on_lr_scaling(lr_scaling)
        if chosen.needs_mpi_threads and not mpi_threads_ok(world):
            raise UsageError(
                f"xb.distribute: RULE={chosen.name} serves from a second thread and needs "
                "MPI_THREAD_MULTIPLE: call xb.init(threads=True) before anything else starts MPI"
            )
        trains = chosen.trains(world.rank, world.size)
        part = _train_part(chosen, world.rank, world.size)
        for loader in _state.loaders:
            loader.check_part(part)
        own = OwnModel(model, optimizer, _steps_per_epoch, precision == "fp16", _state.elastic is None)
        trainers = sum(chosen.trains(r, world.size) for r in range(world.size))
        built.update(rule=chosen, trains=trains, part=part, own=own, trainers=trainers)

    _agree(world, prepare)
    _split_trainers(bool(built["trains"]))
    _broadcast_optimizer_state(world, optimizer)
    _scale_lr(world, optimizer, lr_scaling, lr_cap, built["trainers"])
    own: OwnModel = built["own"]
    _agree(world, lambda: check_same_shapes(world, [tuple(p.shape) for p in own.learner.param_list]))
    chosen: Rule = built["rule"]
    _state.part = built["part"]
    _state.loop.parts = _state.part.count
    comm, window = _communicator(world, chosen, own)
    chosen.bind(comm, own)
    job = _start_job(world, chosen, comm, own, built["trains"], window, precision, noise_scale_every)
    if not job.trains:
        job.serve()
        # This rank's optimizer never steps: a scheduler's "step() before optimizer.step()" is expected.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
    return model, optimizer


def _join_distribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rule: str | Rule,
    precision: str,
    noise_scale_every: int,
    hyper: Mapping[str, Any],
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``distribute`` on a replacement: its arguments checked alone (a failure ends only this process), the
    data part of the start rank it stands for, then its side of the survivors' growth — the communicator,
    the rule's binding, the handover (model, optimizer, rule state; :func:`.elastic_mode.join_rule`) — and
    its hooks counting on from the survivors' step. Collective with the survivors."""
    world, offer = _world("xb.distribute"), _state.joining
    stands_for, parts = offer.ranks[world.rank], int(offer.position["parts"])
    try:
        _check_settings(precision, noise_scale_every, "none", 0.0)
        chosen = _make_rule(rule, hyper)
        _check_rule(chosen, "none", 0.0, precision)
        part = _train_part(chosen, stands_for, parts)
        for loader in _state.loaders:
            loader.check_part(part)
        own = OwnModel(model, optimizer, _steps_per_epoch, precision == "fp16", False)
    except BaseException as exc:
        leave_job(world, exc, None, PREFIX)
    _state.part = part
    _state.loop.parts = parts  # what it tells a replacement of its own, should a survivor be lost later
    comm, window = _communicator(world, chosen, own, offer)
    _state.handed = list(join_rule(chosen, comm, own, world.mpi))
    job = _start_job(_state.world or world, chosen, comm, own, True, window, precision, noise_scale_every)
    assert job.hooks is not None
    job.hooks.step = int(offer.position["step"])
    _state.joining = None
    log.warning(
        "elastic: replaces start rank %d on %s from step %d (pid %d)",
        stands_for,
        world.hostname,
        job.hooks.step,
        os.getpid(),
    )
    return model, optimizer


def _train_part(rule: Rule, rank: int, size: int) -> Part:
    """The part of the training data ``rule`` gives start rank ``rank`` of ``size`` (none to a rank it
    keeps out of training)."""
    if not rule.trains(rank, size):
        return Part(rank, size, trains=False)
    index, count = rule.train_shard(rank, size)
    return Part(index, count, rule.train_span(rank, size))


def _start_job(
    world: World,
    rule: Rule,
    comm: Communicator,
    own: OwnModel,
    trains: bool,
    window: StepWindow,
    precision: str,
    noise_scale_every: int,
) -> EmbeddedJob:
    """The process's current job, over the bound ``rule``: the model's forward under ``precision``'s
    autocast, the gradient noise scale measured every ``noise_scale_every`` steps."""
    forward = PrecisionForward(own.learner.module, Precision(precision, world.device))
    noise = NoiseScale(noise_scale_every, SessionSection.noise_scale_smoothing, NOISE_UNKNOWN)
    job = _state.job = EmbeddedJob(world, rule, comm, own, trains, forward, noise, window)
    rule.on_noise_scale(lambda: noise.value(size) if (size := _loader_batch()) else math.nan)
    return job


def _communicator(
    world: World, rule: Rule, own: OwnModel, offer: Any = None
) -> tuple[Communicator, StepWindow]:
    """The job's communicator and how its steps run: in elastic training over an elastic communicator,
    under the one owner of fault tolerance (:func:`.elastic_mode.tolerant`; ``offer``: a replacement's,
    built as the survivors' grew), else as they are."""
    section = _state.elastic
    if section is None:
        return make_communicator(_state.comm, world.device, world.mpi), Unguarded()
    assert _state.tracebacks is not None
    state = [ModelState(own), rule, *_state.kept]
    loop, tracebacks = _state.loop, _state.tracebacks
    return tolerant(section, _state.comm, world, rule, own, state, _follow, loop, tracebacks, offer)


def _follow(rank: int, size: int, mpi: Any) -> None:
    """A rank was lost: the world ``xb.init()`` returns, the log lines' ``[rank r/size]`` and the API's own
    collectives (``xb.checkpoint``, ``xb.allreduce`` after ``xb.finish``) are the survivors' (rank 0 is the
    lowest survivor; ``mpi`` their communicator). Collective over the survivors (inside the recovery)."""
    assert _state.world is not None
    world = _state.world = replace(_state.world, rank=rank, size=size, mpi=mpi)
    _state.control = mpi.Dup()  # the old one spans the lost rank: never freed (collective over the dead)
    _state.trainers = None  # elastic jobs reduce over the rule's communicator while they run
    if _state.job is not None:
        _state.job.world = world
    setup_logging(
        world.rank, world.size, _state.init_args.get("log_level", "info").upper() if world.rank == 0 else None
    )


def keep(*objects: Any) -> None:
    """Restore ``objects`` with the model when elastic training drops the steps a lost rank interrupted:
    anything with ``state_dict`` and ``load_state_dict`` that the training steps change — an lr scheduler
    (whose rate the restored optimizer carries), a GradScaler, your own counters. Call it after
    ``xb.distribute`` and before the loop; without ``xb.init(elastic=True)`` it only checks them. Local."""
    _job("xb.keep")
    for obj in objects:
        check_keepable(obj)
    for obj in objects:  # a replacement: the state the survivors handed over for it
        if _state.handed:
            obj.load_state_dict(_state.handed.pop(0))
    _state.kept.extend(objects)
    if _state.job is not None:
        for obj in objects:
            _state.job.window.add_state(obj)


#: ``lr_scaling``'s choices (``[optim] lr_scaling``'s).
LR_SCALINGS = ("none", "sqrt", "linear")


def _check_rule(rule: Rule, lr_scaling: str, lr_cap: float, precision: str) -> None:
    """A rate scaled with k learners that each step on their own batch needs a cap (rules/lr_recipe.py);
    elastic training takes the rules its embedded mode can drop a step of (``elastic_mode.check_rule``)."""
    problem = uncapped_scaling(rule, lr_scaling, lr_cap, ("xb.distribute(lr_scaling=...)", "lr_cap"))
    if problem:
        raise UsageError(problem)
    if _state.elastic is not None:
        check_rule(rule, precision)


def _check_settings(precision: str, noise_scale_every: int, lr_scaling: str, lr_cap: float) -> None:
    """:func:`distribute`'s keyword settings, each refused in one UsageError naming it."""
    if not isinstance(noise_scale_every, int) or noise_scale_every < 0:
        raise UsageError(f"xb.distribute: noise_scale_every must be an int >= 0, got {noise_scale_every!r}")
    if lr_scaling not in LR_SCALINGS:
        raise UsageError(
            f"xb.distribute: lr_scaling={lr_scaling!r}: choose one of {', '.join(map(repr, LR_SCALINGS))}"
        )
    if not isinstance(lr_cap, int | float) or lr_cap < 0:
        raise UsageError(f"xb.distribute: lr_cap must be a number >= 0 (0: no cap), got {lr_cap!r}")
    if precision not in DTYPES:
        raise UsageError(
            f"xb.distribute: precision={precision!r}: choose one of {', '.join(map(repr, DTYPES))}"
        )


def _broadcast_optimizer_state(world: World, optimizer: torch.optim.Optimizer) -> None:
    """Every rank's optimizer takes rank 0's ``state_dict`` (collective; tensors travel through the host)."""
    if _state.control is None or world.size == 1:
        return
    mine = _to_cpu(optimizer.state_dict()) if world.rank == 0 else None
    state = _state.control.bcast(mine, root=0)
    if world.rank != 0:
        optimizer.load_state_dict(state)  # casts the state to each parameter's device and dtype


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it copied to the CPU (dicts and lists walked)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _scale_lr(world: World, optimizer: torch.optim.Optimizer, scaling: str, cap: float, k: int) -> None:
    """``lr_scaling``: every param group's rate times 1, √k or k, at most ``cap`` (see :func:`distribute`)."""
    if scaling == "none":
        return
    factor = lr_scale(scaling, max(k, 1))
    rates = []
    for group in optimizer.param_groups:
        rate = group["lr"] * factor
        group["lr"] = min(rate, cap) if cap else rate
        rates.append(group["lr"])
    if world.rank == 0:
        capped = f", capped at {cap:g}" if cap and any(r == cap for r in rates) else ""
        log.info(
            "lr_scaling = %s over %d training rank(s): lr x %.4g%s -> %s",
            scaling,
            k,
            factor,
            capped,
            ", ".join(f"{r:g}" for r in rates),
        )


def _split_trainers(trains: bool) -> None:
    """The group :func:`allreduce` reduces over while this job runs: the ranks that train (collective)."""
    from mpi4py import MPI

    if _state.trainers is not None:
        _state.trainers.Free()
        _state.trainers = None
    if _state.control is not None:
        group = _state.control.Split(0 if trains else MPI.UNDEFINED, _state.control.Get_rank())
        _state.trainers = group if group != MPI.COMM_NULL else None


def allreduce(value: Any, op: str = "mean") -> Any:
    """``value`` (a Python number or a tensor) reduced over the ranks with ``op`` (``mean``, ``sum``,
    ``max``, ``min``): Horovod's ``hvd.allreduce``, for metrics such as a validation loss or accuracy.

    Returns a new value of the same kind (a tensor keeps its dtype and device). While a job runs under a rule
    that keeps ranks out of training (parameter servers), the ranks that train take part, which are the
    ones running the loop; otherwise every rank. Collective over those ranks. See :mod:`.metric_reduce`.
    """
    _world("xb.allreduce")
    job = _state.job
    if job is not None and _state.elastic is not None and not job.finished:  # over the survivors
        return job.window.collective(lambda: reduce_over(job.comm, value, op), "xb.allreduce")()
    comm = _state.trainers if job is not None and not job.finished else _state.control
    if comm is None:  # a process without MPI reduces with itself
        from mpi4py import MPI

        comm = MPI.COMM_SELF
    return allreduce_value(comm, value, op)


def _make_rule(rule: str | Rule, hyper: Mapping[str, Any]) -> Rule:
    if isinstance(rule, Rule):
        if hyper:
            raise UsageError(
                f"xb.distribute: {sorted(hyper)} given with a Rule instance; pass them to its constructor"
            )
        return rule
    if not isinstance(rule, str):
        raise UsageError(f"xb.distribute: rule must be a name or a Rule instance, got {type(rule).__name__}")
    name, *settings = rule.split()
    given = {}
    for item in settings:
        key, equals, value = item.partition("=")
        if not equals or not key:
            raise UsageError(f"xb.distribute: rule {rule!r}: '{item}' is not key=value")
        given[key] = value
    return build_rule(name, {**given, **hyper})


def _steps_per_epoch() -> int | None:
    """Batches per epoch of the first live loader from :func:`shard`, or None."""
    return next((len(loader) for loader in _state.loaders), None)


def _world(what: str) -> World:
    """The world of :func:`init`; before it, a UsageError saying that ``what`` needs ``xb.init`` first.

    No implicit start: an ``init`` made behind the user's back would fix the device and binding, and the
    user's own ``xb.init(devices=...)`` after it could only fail."""
    if _state.world is None:
        raise UsageError(
            f"{what} before xb.init(): call xb.init(...) first, on every rank (it joins the MPI world and "
            "picks this rank's device)"
        )
    return _state.world


def _job(what: str) -> EmbeddedJob:
    """The current job; before :func:`distribute` (or :func:`init`), a UsageError naming ``what``."""
    _world(what)
    if _state.job is None:
        raise UsageError(f"{what} before xb.distribute(model, optimizer, rule=...)")
    return _state.job


@contextmanager
def consensus(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block ``model`` holds the rule's consensus weights (SMA's z, EASGD's centre, the server's
    w, GOSGD's weighted mean after the end, BSP's shared weights), afterwards its own replica again.

    For a synchronous rule it is collective: every rank enters the block at the same point (where every
    rank validates). An asynchronous rule shows what this rank holds without communicating until
    :func:`finish`, then the final consensus. See :mod:`.embedded_job`.
    """
    job = _job("xb.consensus")
    if model is not job.module:
        raise UsageError("xb.consensus(model): this is not the model given to xb.distribute")
    with params_loaded(job.own.learner, job.consensus()):
        yield model


def finish() -> bool:
    """Drain everything in flight, agree on the consensus and leave it in the model's weights. Collective;
    call it on every rank after the training loop (nothing to drain without a running job).

    Returns True on rank 0 only: every rank now holds the same model, and ``if xb.finish(): torch.save(...)``
    writes it once instead of once per rank into the same file.
    """
    _world("xb.finish")
    if _state.job is not None:
        _state.job.finish()
    _state.part, _state.loaders = None, weakref.WeakSet()  # the next job cuts its own loaders' parts
    _state.kept, _state.loop, _state.handed = [], LoopPosition(), []
    world = _world("xb.finish")  # elastic training: the survivors' world, when a rank was lost
    return world.rank == 0


def checkpoint(path: str | Path) -> None:
    """Collective: save the rule's state (SMA's z, EASGD's centre, step counts) into folder ``path``; save
    your model's and optimizer's ``state_dict`` beside it. Synchronous rules only."""
    _job("xb.checkpoint").checkpoint(Path(path))


def restore(path: str | Path) -> None:
    """Load what :func:`checkpoint` saved into the running job (after ``xb.distribute`` and your own
    ``load_state_dict`` calls)."""
    _job("xb.restore").restore(Path(path))


def noise_scale(batch_size: int | None = None) -> float:
    """The gradient noise scale B_noise of the distributed model, in samples: the batch size beyond which a
    larger batch stops paying off (McCandlish et al. 2018; :mod:`mpicrossbow.training.tuning.noise_scale`).

    Smoothed over the estimates so far (every ``noise_scale_every`` steps of ``xb.distribute``); NaN before
    the first, while the gradient is still lost in its noise, or where it cannot be estimated: the embedded
    API has one learner per rank, so it needs BSP (gradient mode) on 2 or more ranks. ``batch_size``: the
    samples of one optimizer step on one rank (default: the batch size of :func:`shard`'s loader).
    Local: no communication (every rank of a synchronous rule holds the same value)."""
    job = _job("xb.noise_scale")
    size = batch_size or _loader_batch()
    if size is None:
        raise UsageError(
            "xb.noise_scale(): no xb.shard loader gives the batch size; pass batch_size= (samples of one "
            "optimizer step on one rank)"
        )
    return job.noise.value(size)


def _loader_batch() -> int | None:
    """The batch size of the first :func:`shard` loader (None: no loader yet)."""
    return next((loader.batch_size for loader in _state.loaders), None)


def trains() -> bool:
    """Whether this rank trains under the current rule (False on a parameter server's ranks)."""
    return _state.job.trains if _state.job is not None else True


# ------------------------------------------------------------------ failures
def _agree(world: World, prepare: Any) -> None:
    """Run ``prepare`` on every rank; if it failed anywhere, rank 0 has printed why and every rank exits."""
    code = agree(world, prepare, PREFIX)
    if code:
        raise SystemExit(code)


def _install_failure_hooks() -> None:
    """An uncaught exception ends every rank (one line); leaving with a job unfinished ends the job."""
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        world = _state.world
        if world is None or world.size == 1:
            previous(kind, exc, tb)
            return
        assert _state.tracebacks is not None
        _state.failed = True  # MPI_Abort may return before the launcher ends this process
        _state.tracebacks.mkdir(exist_ok=True)
        abort(world, exc, _state.tracebacks, PREFIX)

    sys.excepthook = excepthook
    atexit.register(_at_exit)


def _at_exit() -> None:
    """The script ended with a job still running: finish it alone, or end the whole job (peers may wait)."""
    job, world = _state.job, _state.world
    if job is None or job.finished or world is None or _state.failed:
        return
    if world.size == 1:
        log.warning("xb.finish() was not called; finishing RULE=%s at exit", job.rule.name)
        job.finish()
        return
    try:
        abort_job(
            world,
            f"rank {world.rank} of {world.size} on {world.hostname} reached the end of the script with RULE="
            f"{job.rule.name} unfinished: call xb.finish() on every rank after training",
            1,
            prefix=PREFIX,
        )
    except SystemExit as exc:  # MPI_Abort returned first: leave now (SystemExit in an exit hook is printed)
        sys.stderr.flush()
        os._exit(exc.code if isinstance(exc.code, int) else 1)
