"""Export synthetic LArTPC events to PILArNet-M style HDF5 (or parquet) files.

    python tools/export_pilarnet.py --out DIR --num-events N --seed S --split train \
        [--events-per-file K] [--voxel-size V] [--revision v2] [--format h5|parquet] [--overwrite]

With ``--format parquet`` the same events go to ``DIR/<split>/lartpc_s<seed>_<part>.parquet``
in upstream's parquet layout (one row an event, with ``n_points`` and
``event_id``), read by ``PILArNetParquetDataset`` and
``PILArNetParquetIterableDataset`` (needs pyarrow: ``pip install "pimm[parquet]"``).

Writes ``DIR/<split>/lartpc_s<seed>_<part>.h5`` in the PILArNet-M layout of
``--revision`` (v1, v2 -- the default -- or v3; see docs/pilarnet.md), plus
the ``<part>_points.npy`` per-event point counts next to each file that
upstream pimm's reader (and ours) use to filter by ``min_points`` without
reading every event. ``PILArNetH5Dataset(data_root=DIR, split=...)`` -- ours
or upstream's -- reads them back. Event ``i`` of the export is event ``i`` of
``LArTPCSynthDataset(seed=S, split=split)``, so exports are reproducible.
Existing files are never overwritten unless ``--overwrite`` is given, which
also removes leftover parts of an earlier export with the same seed. Bad
arguments print one ``error: ...`` line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pimm.datasets.lartpc import LArTPCSynthDataset  # noqa: E402
from pimm.datasets.pilarnet import REVISIONS, write_pilarnet_h5  # noqa: E402
from pimm.datasets.pilarnet_parquet import write_pilarnet_parquet  # noqa: E402
from pimm.datasets.point_dataset import SPLITS  # noqa: E402
from pimm.utils.errors import UserError  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every pimm CLI
        raise UserError(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description="Export synthetic LArTPC events to PILArNet-M style HDF5 files.")
    p.add_argument("--out", required=True, help="output directory (files go to OUT/<split>/)")
    p.add_argument("--num-events", type=int, required=True, help="number of events to export")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    p.add_argument("--split", default="train", help="train, val or test (default train)")
    p.add_argument("--events-per-file", type=int, default=1000, help="events per .h5 file (default 1000)")
    p.add_argument("--voxel-size", type=float, default=1.0, help="voxel size in detector units (default 1)")
    p.add_argument("--revision", default="v2", help="PILArNet-M layout: v1, v2 or v3 (default v2)")
    p.add_argument("--format", default="h5", help="h5 (default) or parquet")
    p.add_argument("--overwrite", action="store_true", help="replace existing files")
    args = p.parse_args(argv)
    if args.num_events < 1:
        raise UserError(f"--num-events must be at least 1, got {args.num_events}")
    if args.events_per_file < 1:
        raise UserError(f"--events-per-file must be at least 1, got {args.events_per_file}")
    if args.seed < 0:
        raise UserError(f"--seed must be non-negative, got {args.seed}")
    if args.split not in SPLITS:
        raise UserError(f"--split {args.split!r} is not one of {', '.join(SPLITS)}")
    if args.format not in ("h5", "parquet"):
        raise UserError(f"--format {args.format!r} is not one of h5, parquet")
    if args.revision not in REVISIONS:
        raise UserError(f"--revision {args.revision!r} is not one of {', '.join(REVISIONS)}")
    return args


def export(args: argparse.Namespace) -> list[Path]:
    dataset = LArTPCSynthDataset(num_events=args.num_events, seed=args.seed, split=args.split,
                                 voxel_size=args.voxel_size)
    out_dir = Path(args.out) / args.split
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a directory")
    n_files = -(-args.num_events // args.events_per_file)
    paths = [out_dir / f"lartpc_s{args.seed}_{part:04d}.{args.format}" for part in range(n_files)]
    targets = paths + [p.with_name(p.stem + "_points.npy") for p in paths if args.format == "h5"]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not args.overwrite:
        raise UserError(f"{existing[0]} already exists ({len(existing)} file(s) would be overwritten); "
                        "pass --overwrite or choose another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    for part, path in enumerate(paths):
        start = part * args.events_per_file
        stop = min(start + args.events_per_file, args.num_events)
        events = (dataset[i] for i in range(start, stop))
        if args.format == "parquet":
            write_pilarnet_parquet(events, path, revision=args.revision)
        else:
            write_pilarnet_h5(events, path, revision=args.revision)
    # Parts of an earlier, larger export with the same seed would otherwise be
    # read along with the new files.
    for stale in out_dir.glob(f"lartpc_s{args.seed}_[0-9][0-9][0-9][0-9]*"):
        same_format = stale.suffix == f".{args.format}" or (args.format == "h5" and stale.name.endswith("_points.npy"))
        if stale not in targets and same_format:
            stale.unlink()
    return paths


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        t0 = time.perf_counter()
        paths = export(args)
    except (UserError, OSError) as err:  # OSError: unwritable directory, full disk
        if os.environ.get("PIMM_DEBUG") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.num_events} events ({args.revision}) to {len(paths)} file(s) in {paths[0].parent} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
