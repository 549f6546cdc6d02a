"""Data sets that train through a ``torch.utils.data.DataLoader``: image folders, packed HDF5 shards, their
transforms, and a generator of a small learnable image set for tests and benchmarks (docs/data.md)."""
