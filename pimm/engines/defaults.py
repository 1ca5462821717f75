"""Upstream pimm's (detectron2-style) script helpers, for training scripts
written against them::

    from pimm.engines.defaults import default_argument_parser, default_config_parser, default_setup
    from pimm.engines.launch import launch
    from pimm.engines.train import TRAINERS

    def main_worker(cfg):
        cfg = default_setup(cfg)
        TRAINERS.build(dict(type=cfg.train.type, cfg=cfg)).train()

    args = default_argument_parser().parse_args()
    cfg = default_config_parser(args.config_file, args.options)
    launch(main_worker, args.num_gpus, args.num_machines, args.machine_rank, args.dist_url, cfg=(cfg,))

Each does pimm's part of the job: the config is read as ``tools/train.py``
reads it (``_base_``, ``hooks_override``, runtime defaults), the options
(upstream's ``KEY=VALUE`` dict, :class:`~pimm.utils.dict_action.DictAction`)
are applied and recorded for a resume, and a fresh run refuses a save_path
that holds an earlier run's results instead of writing over it. The trainer
built from the config does the rest of pimm's start-up itself (hooks,
validation). ``tools/train.py`` remains the full command line: run lock,
attempt records, Ctrl-C and pre-emption handling.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

from pimm.utils import comm
from pimm.utils.config import Config
from pimm.utils.dict_action import DictAction
from pimm.utils.errors import ConfigError
from pimm.utils.rng import derive_seed, seed_all

__all__ = ["default_argument_parser", "default_config_parser", "default_setup"]


def default_argument_parser(epilog: str | None = None) -> argparse.ArgumentParser:
    """Upstream's training-script arguments: ``--config-file``, ``--num-gpus``
    (per machine), ``--num-machines``, ``--machine-rank``, ``--dist-url``
    (see :func:`pimm.engines.launch.launch`) and ``--options KEY=VALUE ...``."""
    parser = argparse.ArgumentParser(
        epilog=epilog or f"example: {sys.argv[0]} --config-file CFG --num-gpus 2 --options epoch=10 save_path=exp/a",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-file", default="", metavar="FILE", help="the config file")
    parser.add_argument("--num-gpus", type=int, default=1, help="processes (GPUs) per machine")
    parser.add_argument("--num-machines", type=int, default=1, help="machines in the job")
    parser.add_argument("--machine-rank", type=int, default=0, help="this machine's rank (0 .. num-machines - 1)")
    parser.add_argument("--dist-url", default="auto", help="where the ranks meet: auto, tcp://HOST:PORT, env, slurm")
    parser.add_argument("--options", nargs="+", action=DictAction, help="config overrides, KEY=VALUE ...")
    return parser


def _config_file(file_path: str) -> str:
    """``file_path``, or upstream's ``dataset-config`` shorthand for ``dataset/config``."""
    if os.path.isfile(file_path) or str(file_path).startswith("pimm://"):
        return file_path
    sep = file_path.find("-")
    shorthand = os.path.join(file_path[:sep], file_path[sep + 1:]) if sep > 0 else None
    if shorthand and os.path.isfile(shorthand):
        return shorthand
    also = f" (nor {shorthand})" if shorthand else ""
    raise ConfigError(f"config file {file_path!r} not found{also}: give the path of a config file")


def default_config_parser(file_path: str, options: dict | None, *, save_artifacts: bool = True) -> Config:
    """The config of ``file_path`` with the runtime defaults and ``options``
    (``{key: value}``, e.g. from :class:`DictAction`) applied; ``seed=None``
    draws a seed. With ``save_artifacts`` a fresh run (``resume`` off) writes
    ``config.py`` and upstream's records into ``save_path``, after checking
    that it holds no earlier run's results (a ConfigError if it does)."""
    from pimm.engines.run.run_dir import guard_fresh_run, write_config
    from pimm.engines.run.run_records import apply_launch_command
    from pimm.engines.run.runtime import apply_runtime_defaults

    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"default_config_parser(options={options!r}): give a dict of KEY: value (or None)")
    cfg = Config.fromfile(_config_file(file_path))
    apply_runtime_defaults(cfg)
    tokens = [f"{key}={value!r}" for key, value in (options or {}).items()]  # values as literals, as --options takes
    cfg.merge_from_options(tokens)
    cfg.set_command_options(tokens)  # recorded in config.py: a resume applies them again
    if cfg.get("seed") is None:
        cfg.seed = random.SystemRandom().randrange(2**31)
    apply_launch_command(cfg)
    if save_artifacts and not cfg.resume and comm.is_main_process():
        guard_fresh_run(cfg)
        write_config(cfg)
    return cfg


def default_setup(cfg: Config) -> Config:
    """Upstream's per-process settings for this process's world size:
    ``num_worker_per_gpu``, ``batch_size_per_gpu``, ``batch_size_val_per_gpu``,
    ``batch_size_test_per_gpu`` (the global sizes split evenly: a ConfigError
    when one does not divide), and this rank's RNG streams seeded as pimm's
    trainer seeds them. ``num_worker=None``: one worker per CPU."""
    world_size = comm.get_world_size()
    if cfg.get("num_worker") is None:
        cfg.num_worker = os.cpu_count() or 1
    cfg.num_worker_per_gpu = cfg.num_worker // world_size
    for key in ("batch_size", "batch_size_val", "batch_size_test"):
        size = cfg.get(key)
        if size is not None and size % world_size:
            raise ConfigError(f"{key}={size} does not split evenly across {world_size} processes: make it a "
                              f"multiple of {world_size}")
    cfg.batch_size_per_gpu = cfg.batch_size // world_size
    for kind in ("val", "test"):
        size = cfg.get(f"batch_size_{kind}")
        cfg[f"batch_size_{kind}_per_gpu"] = size // world_size if size is not None else 1
    if cfg.get("seed") is not None:
        seed_all(derive_seed(cfg.seed, 1, comm.get_rank()))
    return cfg
