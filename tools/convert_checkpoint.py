"""Convert a checkpoint to one plain weight file:
``python tools/convert_checkpoint.py CKPT_DIR OUT.pth [--overwrite]``.

``CKPT_DIR`` is a checkpoint folder (``save_path/checkpoints/step...-epoch...``),
or a run's ``checkpoints/`` folder or ``save_path`` (then its newest intact
checkpoint). A sharded checkpoint of an FSDP run (any number of processes)
is read in this one process, without a process group; the output has the
format of ``model/model_last.pth`` and loads with ``torch.load(OUT,
weights_only=True)``. An existing ``OUT`` is replaced only with
``--overwrite``, and never inside a checkpoint folder (the input's own
``common.pth`` included). The checkpoint is read as data: a ``common.pth``
that names any other type is refused (exit 2) unless
``--trust-checkpoint-code`` (checkpoints written before pimm saved plain
states; see docs/security.md). Bad arguments print one ``error: ...`` line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pimm.utils.errors import EXIT_USAGE, UserError  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every pimm CLI
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise UserError(f"{message} (usage: {usage})")


def _refuse_output_inside_a_checkpoint(source: str, out: str) -> None:
    """OUT must not be a file of the checkpoint being read, nor of any other
    committed checkpoint: ``--overwrite`` would replace a checkpoint's own
    ``common.pth`` and the next resume would silently lose its state."""
    from pimm.engines.state.convert import find_checkpoint
    from pimm.engines.state.manager import MANIFEST

    target = Path(out).resolve()
    checkpoint = find_checkpoint(source).resolve()
    inside = next((parent for parent in target.parents if parent == checkpoint or (parent / MANIFEST).is_file()), None)
    if inside is not None:
        raise UserError(f"{out} is inside the checkpoint {inside}; writing it would change that checkpoint (the "
                        "converted input itself, with --overwrite): give a path outside checkpoints, e.g. "
                        "model_converted.pth")


def main(argv: list[str] | None = None) -> int:
    try:
        parser = _Parser(prog="tools/convert_checkpoint.py",
                         description="Write the model weights of a (sharded or whole) checkpoint to one file.")
        parser.add_argument("checkpoint", metavar="CKPT_DIR",
                            help="a checkpoint folder, a checkpoints/ folder or a save_path (then its newest checkpoint)")
        parser.add_argument("out", metavar="OUT.pth", help="the file to write (the format of model/model_last.pth)")
        parser.add_argument("--overwrite", action="store_true", help="replace OUT.pth if it exists")
        parser.add_argument("--trust-checkpoint-code", action="store_true",
                            help="also load a checkpoint that holds more than data (written before pimm saved plain "
                                 "states); unpickling it runs whatever code it names: only for checkpoints you trust")
        args = parser.parse_args(argv)
        from pimm.engines.state.convert import convert_checkpoint

        _refuse_output_inside_a_checkpoint(args.checkpoint, args.out)
        checkpoint, out = convert_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite,
                                             trust_code=args.trust_checkpoint_code)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {out} (the model weights of {checkpoint})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
