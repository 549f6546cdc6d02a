"""Data readers for mpicrossbow: each is a :class:`~mpicrossbow.shard.ShardedArrays` of one rank's rows.

* :class:`data.digits.Digits` -- the 1,797 8x8 UCI handwritten digits in ``digits.h5`` (shipped, CC BY 4.0).
* :class:`data.idx.MNIST` -- MNIST / Fashion-MNIST IDX files (plain or ``.gz``) from a folder.
* :class:`data.cifar.CIFAR10` -- CIFAR-10 binary batches (``cifar-10-batches-bin``) from a folder.
* :class:`data.synthetic.Synthetic` -- deterministic random data of any shape, for benchmarks.

Format modules: :mod:`data.hdf5` (the project's HDF5 layout), :mod:`data.idx` (IDX), :mod:`data.cifar`;
:mod:`data.prepare_digits` rebuilds ``digits.h5`` from scikit-learn.
"""
