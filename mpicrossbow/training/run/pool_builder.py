"""Building this rank's learner pool from the model file: the torch-native form through the engine the cfg
names, the Theano-MPI form through its adapter (one learner, serial)."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from ...config import Config
from ...config.fields import call_kwargs
from ...data.dataset_model import DatasetModel, check_labels
from ...data.loader import LoaderData, LoaderOptions, pin_memory_for
from ...data.registry import build_dataset
from ...errors import ConfigError, ContractError
from ...launch.world import World
from ...model.contract import contract_form, load_model_class
from ...model.shard import Shard
from ...pool.base import LearnerPool
from ...pool.engines import ENGINES
from ...pool.spec import PoolSpec
from ...pool.theano import TheanoPool
from ...rules.base import Rule

log = logging.getLogger(__name__)


def construct(cls: type, kwargs: dict[str, Any], positional: bool = False) -> Any:
    """Instantiate the model class; a failure in the user's constructor becomes one ContractError line."""
    try:
        return cls(kwargs) if positional else cls(**kwargs)
    except TypeError as exc:
        raise ContractError(f"{cls.__name__}(...) could not be constructed: {exc}") from None


def theano_config(
    config: Config, world: World, device: torch.device, part: tuple[int, int]
) -> dict[str, Any]:
    """The dict a Theano-MPI-form model class receives (before the ``[model]`` keys): ``rank`` and ``size``
    are the data part it reads (``part``: the rule's training shard, e.g. rank − 1 of size − 1 for the
    workers of a server, or 0 of 1 on a serving rank, which validates the whole set)."""
    return {
        "rank": part[0],
        "size": part[1],
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
        if rule.needs_gradients:
            raise ContractError(
                f"RULE={config.rule} exchanges gradients, and {config.modelclass} is a Theano-MPI-form model "
                "that updates its own weights in train_iter; RULE=BSP (mode avg), EASGD, GOSGD, SMA, "
                "LOCALSGD, DILOCO, POSTLOCALSGD (bsp_mode avg), ASGD, SSP, PSGD and WEEDOUT exchange weights "
                "and run it"
            )
        if config.pool.learners == "auto" or learners > 1 or config.pool.engine != "serial":
            raise ContractError(
                f"{config.modelclass} is a Theano-MPI-form model (it trains itself in train_iter): it runs "
                "one learner per rank; [pool] learners and engine need a torch-native model"
            )
        if config.pool.cuda_graphs == "on":
            raise ConfigError(
                f"[pool] cuda_graphs = on: {config.modelclass} is a Theano-MPI-form model (it computes its "
                "own step in train_iter), whose step the pool cannot capture; use cuda_graphs = auto or off"
            )
        if config.optim.precision != "fp32":
            raise ContractError(
                f"{config.modelclass} is a Theano-MPI-form model (it computes its own step in train_iter): "
                f"[optim] precision = {config.optim.precision} needs a torch-native model"
            )
        trains = rule.trains(world.rank, world.size)
        part = rule.train_shard(world.rank, world.size) if trains else (0, 1)
        kwargs = {**theano_config(config, world, device, part), **config.model_params}
        return TheanoPool(construct(cls, kwargs, positional=True)), None
    model = torch_model(config, cls, device, learners)
    trains = rule.trains(world.rank, world.size)
    index, count = rule.train_shard(world.rank, world.size) if trains else (0, 1)
    span = rule.train_span(world.rank, world.size) if trains else None
    batch, seed = config.data.batch_size, config.session.seed
    spec = PoolSpec(
        index,
        count,
        batch,
        config.optim,
        device,
        seed,
        learners,
        span,
        config.pool.fuse,
        config.pool.cuda_graphs,
    )
    pool = ENGINES.get(config.pool.engine)(model, spec)
    if config.data.dataset:
        check_labels(pool.learners[0].module, model.train_set, config.data.dataset, device)
    if rule.synchronous:
        return pool, None
    whole = count == 1 and learners == 1  # learner 0 already holds the whole set
    return pool, pool.datas[0] if whole else model.data(Shard(0, 1, batch, seed))


def torch_model(config: Config, cls: Any, device: torch.device, learners: int) -> Any:
    """The torch-native model: ``cls`` built from ``[model]``, or a plain network wrapped with the cfg's data.

    With ``[data] dataset`` set, both splits are built once here and every learner's ``data(shard)`` reads
    its part of them through a DataLoader (replacing a torch-native model's own ``data()``); the rank's
    ``[data] workers`` are shared out among its ``learners``.
    """
    kwargs = call_kwargs(cls, config.model_params, "model")
    form = contract_form(cls)
    data = config.data
    if not data.dataset:
        if form == "module":
            raise ConfigError(
                f"MODELCLASS {config.modelclass} is a plain network (no data() of its own): name its data "
                "with [data] dataset = digits | mnist1d | mnist | cifar10 | imagefolder | shards | "
                "package.module:callable"
            )
        return construct(cls, kwargs)
    train_set = build_dataset(data.dataset, "train", config.dataset_params, data)
    val_set = build_dataset(data.dataset, "val", config.dataset_params, data)
    options = LoaderOptions(
        workers=-(-data.workers // learners),
        prefetch=data.prefetch,
        pin_memory=pin_memory_for(data.pin_memory, device),
        on_bad_sample=data.on_bad_sample,
        verify=data.verify,
    )
    if form == "module":
        return DatasetModel(cls, kwargs, train_set, val_set, options)
    model = construct(cls, kwargs)
    log.info("data: [data] dataset = %s replaces %s.data()", data.dataset, config.modelclass)
    model.data = functools.partial(LoaderData, train_set, val_set, options=options)  # data(shard)
    model.train_set = train_set
    return model
