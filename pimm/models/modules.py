"""Upstream pimm's import path for the point-batch module classes: ``from
pimm.models.modules import PointModule, PointSequential, PointModel``.

``PointModule`` and ``PointSequential`` are PT-v3's own
(:mod:`pimm.models.ptv3.blocks`): a ``PointModule`` child of a
``PointSequential`` gets the whole :class:`~pimm.models.ptv3.structure.Point`,
a sparse convolution runs on its kernel map, any other module maps
``point.feat``. ``PointModel`` is a point model that is also a hook: with
``dict(type="ModelHook")`` in the config's hooks, the trainer calls its
``before_train`` ... ``after_train`` (:class:`~pimm.engines.hooks.upstream.ModelHook`).
"""

from pimm.engines.hooks.base import HookBase
from pimm.models.ptv3.blocks import PointModule, PointSequential

__all__ = ["PointModule", "PointSequential", "PointModel"]


class PointModel(PointModule, HookBase):
    """A point model whose hook methods run in the training loop under ``ModelHook``."""
