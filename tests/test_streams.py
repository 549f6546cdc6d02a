"""The CUDA-streams engine: a clear error without CUDA; on a GPU, the same training as the serial engine."""

from __future__ import annotations

import pytest
import torch

from models.lenet import LeNet
from mpicrossbow.config import OptimSection
from mpicrossbow.errors import ConfigError
from mpicrossbow.pool import SerialPool
from mpicrossbow.pool.engines import ENGINES
from mpicrossbow.pool.spec import PoolSpec
from mpicrossbow.pool.streams import StreamsPool

OPTIM = OptimSection(lr=0.05, momentum=0.9)


def test_streams_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"engine = streams needs a CUDA device.*this rank has cpu"):
        StreamsPool(LeNet(), PoolSpec(0, 1, 8, OPTIM, torch.device("cpu"), learners=2))


def test_engine_registry_lists_the_valid_names() -> None:
    assert ENGINES.get("serial") is SerialPool and ENGINES.get("Streams") is StreamsPool
    with pytest.raises(ConfigError, match=r"unknown engine 'warp'; valid: .*SERIAL.*STREAMS"):
        ENGINES.get("warp")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streams_equal_serial_on_cuda() -> None:
    device = torch.device("cuda", 0)
    pools = []
    for cls in (SerialPool, StreamsPool):
        torch.manual_seed(0)
        pools.append(cls(LeNet(), PoolSpec(0, 1, 16, OPTIM, device, seed=3, learners=4)))
    for pool in pools:
        pool.start_epoch(0)
        for step in range(5):
            pool.compute(step)
            pool.apply()
    torch.cuda.synchronize()
    for a, b in zip(pools[0].learners, pools[1].learners, strict=True):
        torch.testing.assert_close(a.params, b.params, rtol=1e-5, atol=1e-6)
