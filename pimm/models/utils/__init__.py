"""Upstream pimm's ``pimm.models.utils`` package: ``structure`` holds ``Point``."""
