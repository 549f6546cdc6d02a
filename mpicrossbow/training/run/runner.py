"""A rank's whole life: bind its cores, prepare its session, agree with the other ranks, train, and abort
the whole job on any failure. ``crossbow-launch`` under MPI and ``rule.init()`` inside a running world both
come here."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

from ...comm import make_communicator
from ...comm.elastic import elastic_over_mpi
from ...comm.membership import Membership
from ...comm.ulfm import ElasticEnd
from ...config import Config
from ...dynamo_on_demand import spare_dynamo
from ...errors import UsageError
from ...launch.binding import bind, device_label, gather_facts, report
from ...launch.collector import collector_off_then_frozen
from ...launch.devices import device_for_rank
from ...launch.failure import abort, agree, leave_job, record_finished
from ...launch.finalize_fence import bound_finalize
from ...launch.world import World, detect_world
from ...log import setup_logging
from ...rules.base import Rule
from ..elastic.replacement import Offer, connect, merge_with_survivors, receive_handover, replaced_rank
from ..health.preemption import after_signal_stop
from ..reporting.reporting import shown
from ..reporting.result import RunResult
from .session import Session
from .step import train_step

log = logging.getLogger(__name__)


def bind_and_prepare(world: World, session: Session) -> int:
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
        assert session.binding is not None
        report(world, session.binding)
    return code


def prepare_session(config: Config, rule: Rule | None = None) -> tuple[World, Session, int]:
    """This rank's world and session, prepared locally and checked against the other ranks.

    The returned code is 0 when every rank is ready to talk; otherwise every rank returns the same non-zero
    exit status and rank 0 has printed the problem.
    """
    threads = (
        config.rule_params.get("placement") == "colocated"
        or (rule is not None and rule.needs_mpi_threads)
        or bool(config.elastic.enabled and config.elastic.replace)  # replacements start on a thread
    )
    spare_dynamo()  # before the model file builds its optimizer
    world = detect_world(threads)
    setup_logging(world.rank, world.size, config.session.log_level.upper() if world.rank == 0 else None)
    session = Session(config, world, rule)
    with collector_off_then_frozen():  # set-up makes long-lived objects (torch._dynamo, the model, the data)
        code = bind_and_prepare(world, session)
    code = code or agree(world, session.check_consistency)
    if code:
        session.close()  # e.g. rank 0's checkpoint lock, taken while preparing
    return world, session, code


def train(world: World, session: Session) -> RunResult:
    """Connect the ranks (unless ``rule.init()`` connected them already), train to the end and close; any
    exception aborts the whole job with one line — in elastic training only this rank, by a signal the
    survivors see (:func:`~mpicrossbow.launch.failure.leave_job`), unless it is bad input or an interrupt,
    which every rank meets alike."""
    try:
        if session.parts is None:
            session.prepare_collective()
        result = session.run()
        session.close()
    except BaseException as exc:
        tolerant = session.fault_tolerance is not None
        if tolerant and not isinstance(exc, (KeyboardInterrupt, UsageError, ElasticEnd)):
            leave_job(world, exc, session.run_dir)
        if isinstance(exc, ElasticEnd):
            time.sleep(exc.delay_s)  # a survivor before this one in line normally ends the job first
        abort(world, exc, session.run_dir)
    return result


def join_rank(config: Config, replaces: int) -> int:
    """A replacement's life (``[elastic] replace``, the protocol: :mod:`.replacement`): merge with the
    survivors that spawned it, prepare as start rank ``replaces`` would (its device, data shard and seed),
    join their communicator and binding, take the handover and train on from their position. Any failure
    ends only this process, by a signal the survivors see (they recover without it)."""
    from mpi4py import MPI

    spare_dynamo()
    alone = detect_world(threads=True)  # MPI starts: its own COMM_WORLD of one (it may spawn in turn)
    merged = merge_with_survivors()
    connect(merged, merged.size - MPI.COMM_WORLD.Get_size())  # the replacements started together come last
    setup_logging(merged.rank, merged.size, logging.WARNING)
    offer: Offer | None = merged.bcast(None, root=0)
    if offer is None:  # training ended while this process started
        log.warning("elastic: the run ended before replacement of start rank %d could join", replaces)
        bound_finalize()
        return 0
    config = dataclasses.replace(
        config,
        session=dataclasses.replace(config.session, threads=offer.threads),
        checkpoint=dataclasses.replace(config.checkpoint, resume=""),
    )
    start = dataclasses.replace(alone, rank=replaces, size=len(offer.ranks), mpi=merged)
    session = Session(config, start)
    try:
        session.prepare_local(joining=True)
        comm = elastic_over_mpi(
            config.comm,
            session.device,
            merged,
            membership=Membership(offer.version, offer.ranks, merged.rank, offer.hosts),
        )
        local = merged.Split_type(MPI.COMM_TYPE_SHARED, key=merged.rank)
        world = dataclasses.replace(
            start, rank=merged.rank, size=merged.size, local_rank=local.rank, local_size=local.size
        )
        local.Free()
        session.prepare_joined(comm, world, offer, lambda: receive_handover(merged))
    except BaseException as exc:
        leave_job(start, exc, Path(offer.run_dir))
    log.warning(
        "elastic: replaces start rank %d on %s from step %d (pid %d)",
        replaces,
        world.hostname,
        offer.position["step"],
        os.getpid(),
    )
    result = train(world, session)
    code = after_signal_stop(world, session.config, Path(result.run_dir)) if result.stopped else 0
    bound_finalize()
    return code


def run_rank(config: Config, rule: Rule | None = None) -> int:
    """Prepare, agree, train; returns this rank's exit status: 0, 1/2 when set-up failed anywhere, 75 when a
    signal stopped training after a checkpoint (the Slurm job requeued when it can be). A replacement spawned
    by elastic training's survivors takes :func:`join_rank` instead."""
    replaces = replaced_rank()
    if replaces is not None:
        return join_rank(config, replaces)
    world, session, code = prepare_session(config, rule)
    if code:
        return code
    result = train(world, session)
    if result.stopped:
        code = after_signal_stop(world, session.config, Path(result.run_dir))
        if session.fault_tolerance is not None:
            bound_finalize()
        return code
    if session.fault_tolerance is not None:
        bound_finalize()
    now = session.parts.world if session.parts is not None else world  # elastic: the survivors' world
    if now.rank == 0:
        log.info(
            "done: %d epoch(s), %d step(s), val accuracy %s, %.1f s (exchange %.1f s), results in %s",
            result.epochs,
            result.steps,
            shown(result.val_accuracy),
            result.wall_seconds,
            result.exchange_seconds,
            result.run_dir,
        )
        record_finished(Path(result.run_dir))
    return 0


def preview_rank(config: Config) -> tuple[int, str]:
    """``--print-config`` under MPI with ``RULE=AUTO``: what it would choose on this job's ranks, without a
    run. Prepare as a run would (binding, model, data, agreement), bind the rule over a communicator and
    take its measuring window; nothing is saved (no run folder, no checkpoint). Returns the exit
    status (non-zero: bad input, rank 0 said why) and rank 0's decision line ("" elsewhere)."""
    world, session, code = prepare_session(config)
    if code:
        return code, ""
    pool, rule = session.pool, session.rule
    assert pool is not None and rule is not None
    try:
        comm = make_communicator(session.config.comm, session.device, world.mpi)
        rule.bind(comm, pool)
        decision = None
        for step in range(10_000):
            if step % pool.n_batch_train == 0:
                pool.start_epoch(step // pool.n_batch_train)
            train_step(pool, rule, step)
            decision = getattr(rule, "decision", None)
            if decision is not None:
                break
        rule.finish()
        session.close()
    except BaseException as exc:
        abort(world, exc, None)
    return 0, decision.line() if decision is not None and world.rank == 0 else ""
