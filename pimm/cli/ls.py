"""``pimm ls [FOLDER]``: the training configs by the names ``pimm launch
--train.config`` takes (``tests/tiny_semseg``), under the repository's
``configs/`` or one folder of it, as upstream pimm lists them. Bases
(``_base_/``, ``_*.py``) are left out."""

from __future__ import annotations

import sys
from pathlib import Path

from pimm.cli import sites
from pimm.cli.launch_config import list_configs
from pimm.cli.tool_args import ToolParser
from pimm.utils.errors import UserError

__all__ = ["main"]


def _parser() -> ToolParser:
    parser = ToolParser(prog="pimm ls", description="List training configs by name (for pimm launch --train.config).")
    parser.add_argument("folder", nargs="?", default=None, metavar="FOLDER",
                        help="a folder of configs/, e.g. tests or lartpc (default: all of configs/)")
    parser.add_argument("--repo-root", metavar="DIR", default=None,
                        help="the checkout holding configs/ (default: the working directory when it has one, "
                             "else the checkout pimm runs from)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    configs = sites.base_dir(args.repo_root) / "configs"
    if not configs.is_dir():
        raise UserError(f"no configs/ folder in {configs.parent}: run pimm ls in a checkout, or give --repo-root")
    folder = Path(args.folder.strip("/")) if args.folder else Path()  # "": all of configs/
    target = (configs / folder).resolve()
    if not target.is_relative_to(configs.resolve()) or not target.is_dir():
        folders = sorted(p.name for p in configs.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
        raise UserError(f"no config folder {args.folder!r} under {configs} (folders: {', '.join(folders)})")
    names = list_configs(configs, folder.as_posix() if args.folder else "")
    sys.stdout.write("".join(f"{name}\n" for name in names))
    return 0
