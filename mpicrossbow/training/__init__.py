"""Training on one rank: the Session assembles (device, pool, communicator, rule) from a Config; a loop runs
them, one :func:`~mpicrossbow.training.run.step.train_step` at a time, with its components (checkpointing,
reporting, evaluation, signal stop, watchdog, faults, auto-tuner, schedule)."""
