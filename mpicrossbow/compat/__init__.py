"""Theano-MPI compatibility in one place: the ``rule.init()``/``rule.wait()`` facade and its job runner, and
the adapter that trains a Theano-MPI-form model (``train_iter``/``val_iter``) as a learner pool."""
