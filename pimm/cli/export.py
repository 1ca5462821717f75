"""``pimm export``: a model as a portable export folder (``model.safetensors``,
``config.json`` with secrets and paths redacted, ``README.md``) that
:func:`pimm.from_pretrained` loads anywhere (:mod:`pimm.export`).

Two forms, pimm's and upstream's:

* ``pimm export RUN OUT [--weights best|last|PATH]``: RUN is a run directory
  (its ``model_best.pth``, else ``model_last.pth``), a checkpoint folder, a
  weight file or an export folder;
* ``pimm export --run-dir RUN [CHECKPOINT] [OUT]``: CHECKPOINT (default
  ``last``) is ``best``, ``last``, a file name under ``RUN/model/`` or a path.

The config is ``--config FILE`` (run when it is a ``.py``: you named it), else
the ``config.py`` of a run directory (:func:`pimm.export.configs.is_run_directory`:
you pointed the command at your run), else a JSON config beside the weights;
a ``config.py`` beside a weight file is never run (docs/security.md).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path

from pimm.cli.register import register_all
from pimm.utils.errors import UserError

__all__ = ["main", "read_model_card"]

#: The largest model card read (a card is text a person wrote).
CARD_LIMIT = 1 << 20
_NAMED = {"best": "model_best.pth", "last": "model_last.pth"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise UserError(f"{message} (usage: {' '.join(self.format_usage().split()).removeprefix('usage: ')})")


def _parser(prog: str) -> _Parser:
    parser = _Parser(prog=prog, description="Export a run's model for pimm.from_pretrained (and the Hugging Face Hub).")
    parser.add_argument("source", nargs="?", metavar="RUN_OR_CHECKPOINT",
                        help="a run's save_path, a checkpoint folder or a weight file; with --run-dir, the checkpoint "
                             "of the run: best, last (default) or a file under RUN/model/")
    parser.add_argument("out", nargs="?", metavar="OUT", help="the export folder to write (new or empty)")
    parser.add_argument("--run-dir", metavar="RUN", help="the run directory (upstream's form: CHECKPOINT then OUT)")
    parser.add_argument("--weights", metavar="best|last|PATH",
                        help="which weights of RUN: model/model_best.pth (default; model_last.pth when the run has "
                             "no best), model/model_last.pth, or a file or checkpoint folder")
    parser.add_argument("--config", metavar="FILE", help="the config to export with the weights (a .py file is run)")
    parser.add_argument("--model-card", metavar="FILE", help="the README.md to write (default: a generated card)")
    parser.add_argument("--device", default="cpu", help="where tensors are consolidated (checked; pimm uses the CPU)")
    parser.add_argument("--no-safe-serialization", action="store_true",
                        help="write model.bin (a torch file of plain tensors) instead of model.safetensors")
    parser.add_argument("--push-to-hub", metavar="ORG/REPO", help="upload the export to this Hub repository after it "
                                                                   "is written")
    parser.add_argument("--public", action="store_true", help="with --push-to-hub: create a public repository "
                                                              "(default: private)")
    parser.add_argument("--token", help="with --push-to-hub: the Hub token (default: your `hf auth login`); it is "
                                        "written nowhere")
    parser.add_argument("--dry-run", action="store_true", help="print what would be exported and write nothing")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an earlier export in OUT")
    return parser


def read_model_card(path: str) -> str:
    """The text of the card file ``path``: a regular file of at most
    :data:`CARD_LIMIT` bytes of UTF-8 (a device or a FIFO is refused, never read)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise UserError(f"--model-card {path}: {err.strerror}") from None
    with os.fdopen(descriptor, "rb") as handle:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device"
            raise UserError(f"--model-card {path}: {kind}, not a regular file; give a Markdown file")
        data = handle.read(CARD_LIMIT + 1)
    if len(data) > CARD_LIMIT:
        raise UserError(f"--model-card {path}: larger than {CARD_LIMIT // 1024} KiB; a model card is a Markdown page")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"--model-card {path}: not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}); "
                        "save it as UTF-8") from None


def _checkpoint_of_run(run: Path, name: str) -> Path:
    """``--run-dir RUN CHECKPOINT``: best, last, a file under RUN/model/, or a path."""
    model_dir = run / "model"
    candidates = [model_dir / _NAMED[name]] if name in _NAMED else [model_dir / name] + (
        [] if Path(name).suffix else [model_dir / f"{name}{suffix}" for suffix in (".pth", ".safetensors", ".bin")])
    found = next((c for c in candidates if c.exists()), None)
    if found is None and name not in _NAMED and Path(name).exists():
        found = Path(name)
    if found is None:
        raise UserError(f"--run-dir {run}: no checkpoint {name!r} (tried {', '.join(str(c) for c in candidates)}); "
                        "give best, last, a file under model/ or a path")
    return found


def _weights_of_run(run: Path, choice: str) -> Path:
    """``pimm export RUN OUT --weights``: best (else last), last, or a path."""
    if choice not in _NAMED:
        return Path(choice)
    named = run / "model" / _NAMED[choice]
    if named.is_file():
        return named
    if choice == "best" and (run / "model" / _NAMED["last"]).is_file():
        return run / "model" / _NAMED["last"]
    return run  # a checkpoint folder or checkpoints/: the weight source resolves it (or says why not)


def _resolve(args) -> tuple[Path, Path | None]:
    """(the weights, the run directory they were named with, or None)."""
    if args.run_dir is not None:
        if args.weights is not None:
            raise UserError("--weights and --run-dir do not go together: with --run-dir the checkpoint is the first "
                            "argument (best, last or a file under RUN/model/)")
        run = Path(args.run_dir)
        if not run.is_dir():
            raise UserError(f"--run-dir {args.run_dir}: no such directory; give the save_path of a pimm run")
        return _checkpoint_of_run(run, args.source or "last"), run
    if not args.source:
        raise UserError("give the run (or weight file) to export and the folder to write: pimm export RUN OUT "
                        "(or pimm export --run-dir RUN [CHECKPOINT] OUT)")
    source = Path(args.source)
    if not source.exists():
        raise UserError(f"{args.source}: no such run directory or weight file; give the save_path of a pimm run, a "
                        "checkpoint folder or a weight file")
    if source.is_dir():
        return _weights_of_run(source, args.weights or "best"), source
    if args.weights is not None:
        raise UserError(f"--weights picks weights inside a run directory, and {args.source} is a file")
    return source, None


def _config_of(args, weights: Path, run: Path | None) -> tuple[Path | None, dict | None, Path | None]:
    """``(config_path, training_config, the file it comes from)`` for
    save_pretrained: the file the user named, the config.py of a run directory
    (not run here), or a JSON config beside the weights (read as data)."""
    from pimm.engines.state.weight_source import resolve_weight_source
    from pimm.export.configs import find_config, is_run_directory

    if args.config is not None:
        if not Path(args.config).is_file():
            raise UserError(f"--config {args.config}: no such file")
        return Path(args.config), None, Path(args.config)
    if run is not None and is_run_directory(run):
        return run / "config.py", None, run / "config.py"
    found = find_config(resolve_weight_source(weights).folder, opt_in="--config ")
    return (None, found[0], found[1]) if found is not None else (None, None, None)


def main(argv: list[str], prog: str = "pimm export") -> int:
    args = _parser(prog).parse_args(argv)
    if args.run_dir is not None and args.out is None and args.source is not None and not args.dry_run:
        raise UserError(f"--run-dir {args.run_dir} {args.source}: give the folder to write too: pimm export --run-dir "
                        "RUN CHECKPOINT OUT")
    if args.out is None and not args.dry_run:
        raise UserError("give the folder to write: pimm export RUN OUT")
    if args.out is not None and not args.out.strip():
        raise UserError("the export folder is empty (''); give the folder to write, e.g. exports/my-model")
    if (args.public or args.token) and not args.push_to_hub:
        raise UserError("--public and --token go with --push-to-hub ORG/REPO")
    if args.push_to_hub:
        from pimm.export.hub import check_repo_id

        check_repo_id(args.push_to_hub, "--push-to-hub")
    from pimm.export.loading import check_device

    check_device(args.device, "--device")
    card = read_model_card(args.model_card) if args.model_card else None
    weights, run = _resolve(args)
    config_path, training_config, config_file = _config_of(args, weights, run)
    if args.dry_run:
        print(json.dumps({"checkpoint": str(weights), "config": str(config_file) if config_file else None,
                          "output_dir": args.out, "push_to_hub": args.push_to_hub,
                          "safe_serialization": not args.no_safe_serialization, "device": args.device}, indent=2))
        return 0
    register_all()
    from pimm.export import push_to_hub, save_pretrained

    out = save_pretrained(weights, args.out, config_path=config_path, training_config=training_config,
                          model_card=card, overwrite=args.overwrite, device=args.device,
                          safe_serialization=not args.no_safe_serialization)
    written = ", ".join(sorted(p.name for p in out.iterdir() if not p.name.startswith(".")))
    print(f"Exported {weights} to {out} ({written}); load it with pimm.from_pretrained({str(out)!r})")
    if args.push_to_hub:
        push_to_hub(out, args.push_to_hub, private=not args.public, token=args.token)
        print(f"Pushed {out} to the Hugging Face Hub: {args.push_to_hub} ({'public' if args.public else 'private'})")
    return 0
