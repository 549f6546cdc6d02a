"""Building this rank's learner pool from the model file: the torch-native form through the engine the cfg
names, the Theano-MPI form through its adapter (one learner, serial)."""

from __future__ import annotations

from typing import Any

import torch

from ..config import Config
from ..config.fields import call_kwargs
from ..errors import ContractError
from ..launch.world import World
from ..model.contract import contract_form, load_model_class
from ..model.shard import Shard
from ..pool.base import LearnerPool
from ..pool.engines import ENGINES
from ..pool.spec import PoolSpec
from ..pool.theano import TheanoPool
from ..rules.base import Rule


def construct(cls: type, kwargs: dict[str, Any], positional: bool = False) -> Any:
    """Instantiate the model class; a failure in the user's constructor becomes one ContractError line."""
    try:
        return cls(kwargs) if positional else cls(**kwargs)
    except TypeError as exc:
        raise ContractError(f"{cls.__name__}(...) could not be constructed: {exc}") from None


def theano_config(config: Config, world: World, device: torch.device) -> dict[str, Any]:
    """The dict a Theano-MPI-form model class receives (before the ``[model]`` keys)."""
    return {
        "rank": world.rank,
        "size": world.size,
        "device": str(device),
        "verbose": world.rank == 0,
        "seed": config.session.seed,
        "batch_size": config.data.batch_size,
        "lr": config.optim.lr,
        "n_epochs": config.session.epochs,
    }


def build_pool(
    config: Config, world: World, rule: Rule, device: torch.device, learners: int
) -> tuple[LearnerPool, Any]:
    """This rank's pool, and the whole validation set for ranks that validate alone (else None)."""
    cls = load_model_class(config.modelfile, config.modelclass)
    if contract_form(cls) == "theano":
        if not rule.synchronous:
            raise ContractError(f"RULE={config.rule} is asynchronous and needs a torch-native model")
        if config.pool.learners == "auto" or learners > 1 or config.pool.engine != "serial":
            raise ContractError(
                f"{config.modelclass} is a Theano-MPI-form model (it trains itself in train_iter): it runs "
                "one learner per rank; [pool] learners and engine need a torch-native model"
            )
        kwargs = {**theano_config(config, world, device), **config.model_params}
        return TheanoPool(construct(cls, kwargs, positional=True)), None
    model = construct(cls, call_kwargs(cls, config.model_params, "model"))
    trains = rule.trains(world.rank, world.size)
    index, count = rule.train_shard(world.rank, world.size) if trains else (0, 1)
    span = rule.train_span(world.rank, world.size) if trains else None
    batch, seed = config.data.batch_size, config.session.seed
    spec = PoolSpec(index, count, batch, config.optim, device, seed=seed, learners=learners, span=span)
    pool = ENGINES.get(config.pool.engine)(model, spec)
    if rule.synchronous:
        return pool, None
    whole = count == 1 and learners == 1  # learner 0 already holds the whole set
    return pool, pool.datas[0] if whole else model.data(Shard(0, 1, batch, seed))
