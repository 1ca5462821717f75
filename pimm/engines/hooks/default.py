"""Upstream pimm's import path for the hook base class.

``from pimm.engines.hooks.default import HookBase`` is :class:`pimm.engines.hooks.base.HookBase`;
the attributes a hook reads on ``self.trainer`` (``writer``, ``storage``,
``comm_info``, ``best_metric_value``...) are described in docs/hooks.md,
"Coming from upstream pimm".
"""

from pimm.engines.hooks.base import HookBase

__all__ = ["HookBase"]
