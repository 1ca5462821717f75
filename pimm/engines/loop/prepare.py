"""One start-up order for a config, shared by the command line
(:mod:`pimm.engines.run.launch`), a trainer built from Python
(``DefaultTrainer(cfg)``) and the :class:`~pimm.engines.loop.testers.Tester`: the
runtime defaults, the registry dicts, the hooks and their ``modify_config``,
then validation. It imports neither the command line nor the trainers, so
each of them can use it."""

from __future__ import annotations

from pimm.engines.loop.default_hooks import build_run_hooks
from pimm.engines.run.record_form import note_hook_changes
from pimm.engines.run.runtime import apply_runtime_defaults, check_required, check_runtime_domains, validate_runtime
from pimm.utils.config_domains import check_config_domains
from pimm.utils.config_slots import check_registry_dicts
from pimm.utils.errors import ConfigError

__all__ = ["prepare_config"]


def prepare_config(cfg, world_size: int, mode: str = "train") -> list:
    """Complete and check a config in place, in the one start-up order of the
    command line and of a trainer built from Python (``DefaultTrainer(cfg)``):
    the runtime defaults for keys it leaves out, the registry dicts, the hooks
    (``default_hooks`` and the ``hooks`` list) built and each one's ``modify_config``, then validation of every runtime
    key and of what ``mode`` ("train" or "test") cannot do without. Returns the
    built hooks. Bad input is a ConfigError naming the key."""
    if mode not in ("train", "test"):
        raise ConfigError(f"mode must be 'train' or 'test', got {mode!r}")
    apply_runtime_defaults(cfg)
    check_registry_dicts(cfg)
    check_runtime_domains(cfg)  # every declared domain, before anything is built
    check_config_domains(cfg)
    hooks = build_run_hooks(cfg)  # default_hooks, then the config's hooks list (docs/hooks.md)
    with note_hook_changes(cfg):  # the run's records hold the config as the hooks received it
        for hook in hooks:
            hook.modify_config(cfg)
    validate_runtime(cfg, world_size)
    check_required(cfg, mode)
    return hooks
