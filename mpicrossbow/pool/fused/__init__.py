"""The fused engine's internals: the m replicas as one wider network (layers, replicated, vmapped paths),
the chooser that picks the path and form, the by-hand chain steps and the staging of batches.

:class:`~.fused_pool.FusedPool` is the engine; the rest serves it.
"""
