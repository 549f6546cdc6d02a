"""Theano-MPI's facade: ``rule = BSP(); rule.init(devices=..., modelfile=..., modelclass=...); rule.wait()``.

The rules themselves know nothing of jobs (a plug-in must not know how jobs start). The rule classes the
package exports at its top level (``from mpicrossbow import BSP, SMA, Rule``) are the registry's classes with
:class:`TheanoFacade` mixed in: the same rule, plus ``init``/``wait``, which start a job through
:mod:`.jobs`. A user's own rule that subclasses ``mpicrossbow.Rule`` gets them too.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from ..rules.base import Rule
from ..training.reporting.result import RunResult
from .jobs import Job, start_job


class TheanoFacade:
    """``init``/``wait`` for a rule: start training from Python, then wait for it."""

    _job: Job | None = None

    def init(
        self,
        devices: list[str] | str,
        modelfile: str,
        modelclass: str,
        cfg: str | None = None,
        **sections: Mapping[str, Any],
    ) -> TheanoFacade:
        """Start training: ``rule.init(devices=['cpu0', 'cpu1'], modelfile=..., modelclass=...)``.

        ``sections`` hold cfg sections as dicts (``session={'epochs': 3}, optim={'lr': 0.05}``), on top of
        ``cfg`` if given. Inside an MPI job this joins the running world and prepares the session; run from
        plain Python it starts an MPI job with one rank per device. Returns at once; see :meth:`wait`.
        """
        assert isinstance(self, Rule), "TheanoFacade is mixed into Rule classes only"
        self._job = start_job(self, devices, modelfile, modelclass, cfg, sections)
        return self

    def wait(self) -> RunResult | int:
        """Block until the job started by :meth:`init` ends; return its result or raise its failure."""
        if self._job is None:
            raise RuntimeError("call rule.init(...) before rule.wait()")
        job, self._job = self._job, None
        return job.wait()


@functools.cache
def with_facade(cls: type[Rule]) -> type[Rule]:
    """``cls`` with ``init``/``wait``: a subclass of the same name, remembered as ``facade_of``."""
    return type(cls.__name__, (TheanoFacade, cls), {"facade_of": cls, "__module__": cls.__module__})
