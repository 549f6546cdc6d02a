"""Theano-MPI's job API: the ``rule.init()``/``rule.wait()`` facade and the jobs it starts. It sits above
the run-time (it starts sessions); the Theano-MPI model form itself is part of the model contract
(:mod:`mpicrossbow.model.contract`) and trains through its adapter pool (:mod:`mpicrossbow.pool.theano`)."""
