"""The model contract: what a model file gives mpicrossbow (torch-native or Theano-MPI form), the shard of
the data each rank and learner reads, and the project's own :class:`Residual` block."""

from .contract import TorchModel, check_data, contract_form, load_model_class
from .residual import Residual
from .shard import Shard

__all__ = ["Residual", "Shard", "TorchModel", "check_data", "contract_form", "load_model_class"]
