"""Data sets by name and the parallel input pipeline: any map-style ``torch.utils.data.Dataset`` trained
through a ``DataLoader``, sharded over ranks × learners with equal batches, reshuffled per epoch; image
folders, packed HDF5 shards, their transforms, and a generator of a small image set (docs/data.md)."""
