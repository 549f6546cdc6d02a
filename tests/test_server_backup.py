"""A parameter server's backup (``[elastic] server_backups = 1``, mpicrossbow/rules/server_backup.py), in
process on the fault double: the server lost after replying, after mirroring a push but before replying to
it, or with its last events lost on the way to the backup; the backup lost; held replies across a takeover;
the refusals. What needs a real ULFM job is in tests/test_elastic_mpi.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_elastic_double import parts, pools

from mpicrossbow.comm.base import DoneHandle, Handle
from mpicrossbow.comm.elastic import ElasticCommunicator
from mpicrossbow.config import load_config
from mpicrossbow.errors import ConfigError
from mpicrossbow.rules.parameter_server import ParameterServer
from mpicrossbow.rules.registry import RULES
from mpicrossbow.rules.server_backup import MIRROR_TAG
from mpicrossbow.testing.fault_double import FaultyGroup, FaultyWorld
from mpicrossbow.training.elastic.run_tolerance import RunTolerance, server_backups
from mpicrossbow.training.run.step import train_step

pytestmark = pytest.mark.quick

#: Ranks: 0 serves, 1 and 2 train, 3 is the backup (the last rank).
SIZE, STEPS, WORKERS = 4, 12, (1, 2)


def backed_run(rule_name: str, hyper: dict[str, Any], victim: int, when: str) -> list[Any]:
    """Rank ``victim`` (0: the server, 3: the backup) dies after the server's 7th push: ``replied`` once it
    answered it, ``mirrored`` once it sent it to the backup but before the reply went out, ``lagging`` once it
    answered it with its events 5 to 7 lost on the way to the backup. Each survivor
    returns its server state (or None), its membership after the end and its final w."""
    world, built = FaultyWorld(SIZE, timeout_s=20), pools(SIZE)

    def body(group: FaultyGroup) -> tuple[ParameterServer | None, tuple[int, ...], torch.Tensor, int]:
        comm, pool, me = ElasticCommunicator(group), built[group.me], group.me
        comm.isolate_peers = True
        rule = RULES.get(rule_name)(tau=1, **hyper)
        rule.server_backups = 1
        rule.bind(comm, pool)
        if me in (0, 3):
            die_after_push(world, rule.server, victim, when)
            rule.serve(lambda w, epoch: None)
        else:
            pool.start_epoch(0)
            for step in range(STEPS):
                train_step(pool, rule, step)
        rule.finish()
        RunTolerance(rank_parts(pool, rule, me), comm, 1).settle("the end of training")
        rule.sync_state()
        return rule.server, comm.membership.ranks, rule.w.clone(), getattr(rule, "requests", 0)

    return world.run(body)


def rank_parts(pool: Any, rule: Any, me: int) -> Any:
    """The fault double's parts (test_elastic_double.parts) with rank 0's duties to pass on: a reporter and
    checkpoints that take them over (the server, rank 0, is the one lost)."""
    made = parts(pool, rule, me, SIZE)
    made.reporter = SimpleNamespace(world=made.world, take_over=lambda committed: 0, run_dir="run")
    made.checkpoints.take_over = lambda: False
    return made


def die_after_push(world: FaultyWorld, server: ParameterServer, victim: int, when: str) -> None:
    """Make this rank (the server, 0, or its backup, 3) die at the server's 7th push when it is ``victim``
    (see :func:`backed_run`): the backup as it applies the push, before acknowledging it."""
    me = server.comm.rank
    if me != victim:
        return
    if me == 3:
        replay = server.replay

        def replayed(*args: Any) -> None:
            replay(*args)
            if server.received == 7:
                world.die(3)

        server.replay = replayed  # type: ignore[method-assign]
        return
    assert server.mirror is not None
    forward, release = server.mirror.forward, server._release

    def forwarded(*args: Any, **kwargs: Any) -> None:
        forward(*args, **kwargs)
        if server.received == 7 and when == "mirrored":
            world.die(0)

    def released() -> None:
        release()
        if server.received == 7 and when in ("replied", "lagging"):
            world.die(0)

    server.mirror.forward, server._release = forwarded, released  # type: ignore[method-assign]
    if when == "lagging":  # events 5 to 7 never reach the backup: still in flight when the server dies
        wire = server.mirror.comm  # the mirror's own (uncompressed) channel
        isend = wire.isend

        def lossy(tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
            return DoneHandle() if tag == MIRROR_TAG and server.received > 4 else isend(tensor, dst, tag)

        wire.isend = lossy  # type: ignore[method-assign]


@pytest.mark.parametrize("when", ["replied", "mirrored"])
@pytest.mark.parametrize(
    ("rule_name", "hyper"),
    [("ASGD", {}), ("SSP", {"staleness": 0}), ("PSGD", {"max_advance": 1}), ("WEEDOUT", {})],
)
def test_the_backup_serves_on_with_every_push_applied_exactly_once(
    rule_name: str, hyper: dict[str, Any], when: str
) -> None:
    """The server dies at its 7th push, after replying to it or after sending it to the backup but
    before the reply. The backup takes over, the workers send again the push they had no reply to, and
    the backup answers it without applying it a second time (ASGD ``mirrored``: one resend counted; SSP also
    resends the pushes whose replies it held). Every push of both workers is counted once (clocks 12 and
    12, 24 updates — WEEDOUT's discarded among them — and the DONEs' counts agree), the ranks shrink to 1,
    2, 3 and every survivor ends with the backup's w."""
    results = backed_run(rule_name, hyper, victim=0, when=when)
    assert results[0] is None
    backup = results[3][0]
    assert backup is not None and not backup.shadowing
    assert backup.clock == {1: STEPS, 2: STEPS} and backup.updates + backup.discarded == 2 * STEPS
    assert backup.miscounted == {} and backup.in_flight == 0 and backup.lost == set()
    if rule_name == "ASGD":  # held replies (SSP, PSGD) add resends of pushes applied and held
        assert backup.resent == (1 if when == "mirrored" else 0)
    assert [results[r][3] for r in WORKERS] == [STEPS, STEPS]
    survivors = [results[r] for r in (1, 2, 3)]
    assert all(r[1] == (1, 2, 3) for r in survivors)
    assert all(torch.equal(r[2], backup.w) for r in survivors)


@pytest.mark.parametrize("rule_name", ["ASGD", "SSP"])
def test_pushes_the_backup_never_got_are_sent_again_by_their_workers(
    rule_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The mirror runs up to LAG events behind: the server's events 5 to 7 are lost on the way to the
    backup when the server dies after its 7th push. The replies told each worker which of its pushes the
    backup had acknowledged; each sends the others again after the takeover, so every push is still applied
    exactly once (clocks 12 and 12, 24 updates, the DONEs' counts agree) and the survivors share one w."""
    hyper = {"staleness": 0} if rule_name == "SSP" else {}
    with caplog.at_level("WARNING", logger="mpicrossbow.rules.parameter_server"):
        results = backed_run(rule_name, hyper, victim=0, when="lagging")
    assert "serving its shard from here (4 update(s) mirrored;" in caplog.text  # events 5-7 never came
    backup = results[3][0]
    assert backup.clock == {1: STEPS, 2: STEPS} and backup.updates == 2 * STEPS and backup.miscounted == {}
    assert all(results[r][1] == (1, 2, 3) for r in (1, 2, 3))
    assert all(torch.equal(results[r][2], backup.w) for r in (1, 2, 3))


def test_a_lost_backup_leaves_the_server_serving_alone() -> None:
    """The backup dies at the server's 7th push: the server's next forward meets the loss, it serves on
    without a mirror and every push is applied once; the ranks shrink to 0, 1, 2 and share the server's w."""
    results = backed_run("ASGD", {}, victim=3, when="replied")
    assert results[3] is None
    server = results[0][0]
    assert server.mirror is not None and server.mirror.lost
    assert server.clock == {1: STEPS, 2: STEPS} and server.updates == 2 * STEPS and server.miscounted == {}
    survivors = [results[r] for r in (0, 1, 2)]
    assert all(r[1] == (0, 1, 2) for r in survivors)
    assert all(torch.equal(r[2], server.w) for r in survivors)


def test_without_a_loss_the_backup_mirrors_the_server_bit_for_bit() -> None:
    """No death: the backup's state equals the server's (w bitwise, clocks, updates) when both finish."""
    results = backed_run("ASGD", {}, victim=-1, when="replied")
    server, backup = results[0][0], results[3][0]
    assert torch.equal(server.w, backup.w) and server.clock == backup.clock == {1: STEPS, 2: STEPS}
    assert server.updates == backup.updates == 2 * STEPS and server.mirror.forwarded == 2 * STEPS + 2
    assert results[1][1] == (0, 1, 2, 3)


@pytest.mark.parametrize(
    ("rule", "hyper", "said"),
    [
        ("BSP", {}, "RULE=BSP keeps no parameter server rank to back up"),
        ("ASGD", {"placement": "colocated"}, "placement = colocated keeps no server rank to back up"),
        ("GSP", {}, "RULE=GSP's worker groups do not yet leave room for backup ranks"),
        ("EASGD", {"mode": "async"}, "RULE=EASGD's centre has no backup yet"),
    ],
)
def test_a_rule_without_server_ranks_to_back_up_says_so(rule: str, hyper: dict[str, Any], said: str) -> None:
    """``backups_obstacle`` names why; the session turns it into a ConfigError before training."""
    obstacle = RULES.get(rule)(**hyper).backups_obstacle()
    assert obstacle is not None and said in obstacle


def test_the_model_survives_while_each_shard_keeps_its_server_or_its_backup() -> None:
    """What the snapshot meeting asks when serving ranks were lost (start numbering): 2 servers (0, 1)
    backed by ranks 4 and 5 of 6 hold the model while no shard lost both; without backups, never."""
    rule = RULES.get("ASGD")(servers=2)
    rule.server_backups, rule.start_size = 1, 6
    assert rule.model_survives({0}) and rule.model_survives({0, 5}) and rule.model_survives({4, 5})
    assert not rule.model_survives({1, 5}) and not rule.model_survives({0, 4})
    rule.server_backups = 0
    assert not rule.model_survives({0})


def test_too_few_ranks_for_servers_and_backups_is_refused_naming_both() -> None:
    """ASGD with one server and its backup needs 3 ranks: at 2 the error says why."""
    rule = RULES.get("ASGD")()
    rule.server_backups = 1
    with pytest.raises(ConfigError, match=r"needs at least 3 ranks .*and 1 back them up"):
        rule.trains(0, 2)
    assert [rule.trains(r, 4) for r in range(4)] == [False, True, True, False]
    assert rule.train_shard(2, 4) == (1, 2)


@pytest.mark.parametrize(
    ("overrides", "elastic", "said"),
    [
        (("RULE=ASGD",), False, "[elastic] server_backups = 1 needs elastic training"),
        (("RULE=BSP",), True, "[elastic] server_backups = 1: RULE=BSP keeps no parameter server rank"),
        (("RULE=ASGD", "elastic.server_backups=0"), True, None),
        (("RULE=ASGD", "checkpoint.every_epochs=1"), True, None),
    ],
)
def test_the_session_refuses_backups_it_cannot_honour_naming_why(
    overrides: tuple[str, ...], elastic: bool, said: str | None
) -> None:
    """What the session asks before it builds the pool (``run_tolerance.server_backups``): the count to
    set, or one ConfigError naming the setting and what it needs."""
    config = load_config("launch/digits.cfg", ["elastic.server_backups=1", *overrides])
    rule = RULES.get(config.rule)()
    if said is None:
        assert server_backups(config, rule, elastic) == config.elastic.server_backups
        return
    with pytest.raises(ConfigError) as caught:
        server_backups(config, rule, elastic)
    assert said in str(caught.value)
