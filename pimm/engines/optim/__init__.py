"""Optimisation: everything between a loss and updated weights.

Owns: optimizers built from config with per-parameter-group options
(:mod:`.optimizers`), the one optimizer update every trainer runs
(:mod:`.step`: :class:`~pimm.engines.optim.step.OptimStep`), several networks
with several optimizers (:mod:`.parts`), learning-rate schedules
(:mod:`.scheduler`), ``torch.compile`` (:mod:`.compile`), gradient
checkpointing (:mod:`.grad_checkpoint`) and the OOM back-off that splits a
step's batch (:mod:`.oom_backoff`).

Public surface: this package is also the old module ``pimm.engines.optim``
and re-exports what it held: :func:`build_optimizer` and ``NO_DECAY_RULES``.
A new optimizer is registered in ``OPTIMIZERS``, a new schedule in
``SCHEDULERS`` (:mod:`pimm.engines.registries`).
"""

from pimm.engines.optim.optimizers import NO_DECAY_RULES, build_optimizer

__all__ = ["build_optimizer", "NO_DECAY_RULES"]
