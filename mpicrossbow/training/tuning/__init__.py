"""Tuning while training: the learner auto-tuner and the gradient noise scale."""
