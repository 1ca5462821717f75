"""Upstream pimm's import path for the tester registry: ``from pimm.engines.loop.test
import TESTERS``. A registered tester is named by the config's ``test = dict(type=...)``
(see :mod:`pimm.engines.loop.testers`)."""

from pimm.engines.registries import TESTERS
from pimm.engines.loop.testers import Tester, TesterBase

__all__ = ["TESTERS", "Tester", "TesterBase"]
