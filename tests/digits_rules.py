"""The digits job's rule settings that the multi-rank digits tests and benchmarks share (tests/
test_compression_mpi.py, tests/test_cluster_netns.py, benchmarks/precision.py): one table, so that a rule's
setting for the digits job changes in one place."""

from __future__ import annotations

#: ranks → {label: overrides of launch/digits.cfg}: every rule, at the rank count its digits test runs it
#: (the synchronous rules at 2; the asynchronous, hierarchical and grouped ones at 4).
DIGITS_RULES: dict[int, dict[str, str]] = {
    2: {"BSP": "RULE=BSP", "SMA": "RULE=SMA", "EASGD-sync": "RULE=EASGD"},
    4: {
        "EASGD-async": "RULE=EASGD,rule.mode=async",
        "GOSGD": "RULE=GOSGD,rule.p=0.05",
        "ASGD": "RULE=ASGD",
        "SSP": "RULE=SSP,rule.staleness=2",
        "PSGD": "RULE=PSGD",
        "WEEDOUT": "RULE=WEEDOUT",
        "LOCALSGD-hier-m2": "RULE=LOCALSGD,rule.inner_period=2,pool.learners=2",
        "DILOCO": "RULE=DILOCO",
        "GSP-auto": "RULE=GSP,rule.groups=auto,rule.probe_steps=10",
    },
}
#: ranks → the final validation accuracy every rule of :data:`DIGITS_RULES` reaches on the digits job.
DIGITS_TARGET = {2: 0.95, 4: 0.93}
#: The schedule of the tests that train every rule: 10 epochs, the rate cut at epoch 8 (launch/digits.cfg
#: trains 20, cut at 15). At 4 ranks on one host every rule above, and BSP, SMA (one and two learners per
#: rank), synchronous EASGD and POSTLOCALSGD, ended at 0.936-0.978 (SMA with 2 learners lowest, LOCALSGD
#: 0.944; the synchronous rules' runs are deterministic): half the training of the default schedule.
DIGITS_EPOCHS = 10
DIGITS_SHORT = (f"session.epochs={DIGITS_EPOCHS}", "optim.milestones=8")
