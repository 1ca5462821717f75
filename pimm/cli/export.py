"""``pimm export RUN_DIR OUT``: a run's model as a portable export folder
(``model.safetensors``, ``config.json`` with absolute paths redacted, ``README.md``)
that :func:`pimm.from_pretrained` loads anywhere (see :mod:`pimm.models.pretrained`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pimm.cli.register import register_all
from pimm.utils.errors import UserError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise UserError(f"{message} (usage: {' '.join(self.format_usage().split()).removeprefix('usage: ')})")


def _parser(prog: str) -> _Parser:
    parser = _Parser(prog=prog, description="Export a run's model for pimm.from_pretrained.")
    parser.add_argument("run", metavar="RUN_DIR", help="a run's save_path (or a checkpoint folder, a .pth file)")
    parser.add_argument("out", metavar="OUT", help="the export folder to write")
    parser.add_argument("--weights", default="best", metavar="best|last|PATH",
                        help="which weights of the run: model/model_best.pth (default; model_last.pth when the run "
                             "has no best), model/model_last.pth, or a file or checkpoint folder")
    parser.add_argument("--model-card", metavar="FILE", help="the README.md to write (default: a generated card)")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an earlier export in OUT")
    return parser


def _weights(run: Path, choice: str) -> Path:
    if choice in ("best", "last"):
        if not run.exists():
            raise UserError(f"{run}: no such run directory; give the save_path of a pimm run")
        if not run.is_dir():
            return run
        named = run / "model" / f"model_{choice}.pth"
        if named.is_file():
            return named
        if choice == "best" and (run / "model" / "model_last.pth").is_file():
            return run / "model" / "model_last.pth"
        return run  # a checkpoint folder or checkpoints/: the weight source resolves it (or says why not)
    return Path(choice)


def main(argv: list[str], prog: str = "pimm export") -> int:
    args = _parser(prog).parse_args(argv)
    register_all()
    from pimm.models.pretrained import save_pretrained

    run = Path(args.run)
    card = None
    if args.model_card:
        try:
            card = Path(args.model_card).read_text(encoding="utf-8")
        except OSError as err:
            raise UserError(f"--model-card {args.model_card}: {err.strerror}") from None
    weights = _weights(run, args.weights)
    config_path = run / "config.py" if run.is_dir() and (run / "config.py").is_file() else None
    out = save_pretrained(weights, args.out, config_path=config_path, model_card=card, overwrite=args.overwrite)
    print(f"Exported {weights} to {out} (model.safetensors, config.json, README.md); load it with "
          f"pimm.from_pretrained({str(out)!r})")
    return 0
