"""pimm: a training framework for particle-imaging models."""

__version__ = "0.1.0"
