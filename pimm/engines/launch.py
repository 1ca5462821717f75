"""The command line behind ``tools/train.py`` and ``tools/test.py``.

Exit codes (SPEC): 0 done; 2 bad usage, config or input (one ``error:`` line,
no traceback unless ``PIMM_DEBUG=1``); 75 pre-empted after a committed
checkpoint; 1 any other failure (traceback in ``train.log``).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from pimm.distributed.launch import spawn_local
from pimm.engines.preemption import EXIT_PREEMPTED, TrainingPreempted
from pimm.engines.registries import TRAINERS
from pimm.engines.runtime import apply_runtime_defaults, guard_save_path, validate_runtime
from pimm.utils import comm
from pimm.utils.config import Config
from pimm.utils.errors import ConfigError, UserError
from pimm.utils.files import set_aside
from pimm.utils.logger import setup_logger

__all__ = ["main", "load_config", "build_trainer"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise UserError(f"{message} (usage: {usage})")


def _parser(mode: str) -> _Parser:
    parser = _Parser(prog=f"tools/{mode}.py", description=f"pimm {mode}")
    parser.add_argument("--config-file", required=True, metavar="CFG", help="Python config file")
    parser.add_argument("--num-gpus", type=int, default=1, metavar="N",
                        help="local worker processes to start (nccl on CUDA, gloo on CPU)")
    parser.add_argument("--options", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides, e.g. optimizer.lr=0.01 hooks.CheckpointSaver.save_freq=50")
    return parser


def load_config(config_file: str, options: list[str], world_size: int, mode: str = "train") -> Config:
    cfg = Config.fromfile(config_file)
    apply_runtime_defaults(cfg)
    cfg.merge_from_options(options)
    validate_runtime(cfg, world_size)
    if mode == "train":
        guard_save_path(cfg)
    elif mode == "test" and not cfg.weight:
        raise ConfigError("tools/test.py needs the weights to evaluate: --options weight=PATH/model_best.pth")
    return cfg


def build_trainer(cfg, mode: str = "train"):
    train_cfg = dict(cfg.train)
    return TRAINERS.build(dict(train_cfg, cfg=cfg, **({"mode": "test"} if mode == "test" else {})))


def _write_config(cfg) -> None:
    path = Path(cfg.save_path) / "config.py"
    if path.exists():
        # A resume of the same run rewrites config.py in place; any other
        # difference keeps the earlier file beside it.
        try:
            earlier = Config.fromfile(str(path))
        except UserError:
            earlier = {}
        if {k: v for k, v in earlier.items() if k != "resume"} == {k: v for k, v in cfg.items() if k != "resume"}:
            cfg.dump(str(path))
            return
    set_aside(path)  # an earlier run's config is kept, never overwritten
    cfg.dump(str(path))


def _run(args, mode: str) -> int:
    comm.init_distributed_from_env()
    cfg = load_config(args.config_file, args.options, comm.get_world_size(), mode)
    logger = setup_logger(cfg.save_path, comm.get_rank())
    if comm.is_main_process() and mode == "train":
        _write_config(cfg)
    logger.info(f"pimm {mode}: {args.config_file} (world size {comm.get_world_size()}, save_path {cfg.save_path})")
    try:
        trainer = build_trainer(cfg, mode)
        if mode == "train":
            trainer.train()
        else:
            trainer.test()
    except (UserError, TrainingPreempted):
        raise
    except BaseException as err:
        if not getattr(err, "_pimm_logged", False):
            logger.exception(f"{mode} failed")
        raise
    return EXIT_OK


def main(argv: list[str] | None = None, mode: str = "train") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("PIMM_DEBUG") == "1"
    try:
        args = _parser(mode).parse_args(argv)
        if args.num_gpus < 1:
            raise UserError(f"--num-gpus {args.num_gpus} is invalid: give 1 or more")
        if args.num_gpus > 1 and "WORLD_SIZE" not in os.environ:
            # Validate once here, so bad input gives one error line rather than N.
            load_config(args.config_file, args.options, args.num_gpus, mode)
            child_argv = _strip_num_gpus(argv)
            return spawn_local([sys.argv[0], *child_argv], args.num_gpus)
        return _run(args, mode)
    except UserError as err:
        if debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingPreempted:
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if debug:
            traceback.print_exc()
        print(f"error: {mode} failed: {err.__class__.__name__}: {err} (traceback in train.log)", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        comm.destroy_distributed()


def _strip_num_gpus(argv: list[str]) -> list[str]:
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--num-gpus":
            skip = True
            continue
        if token.startswith("--num-gpus="):
            continue
        out.append(token)
    return out
