"""The registries every pluggable piece is looked up in.

They live at the engine layer so the engine can build datasets, models and
hooks named in a config without importing any concrete domain module; the
domain packages register into them and re-export the ones users import
(``pimm.datasets.DATASETS``, ``pimm.models.MODELS``).
"""

from pimm.utils.registry import Registry

TRAINERS = Registry("trainer")
HOOKS = Registry("hook")
OPTIMIZERS = Registry("optimizer")
SCHEDULERS = Registry("scheduler")
MODELS = Registry("model")
DATASETS = Registry("dataset")
TRANSFORMS = Registry("transform")
COLLATE_FNS = Registry("collate function")
TESTERS = Registry("tester")
