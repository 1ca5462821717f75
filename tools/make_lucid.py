"""Generate LUCiD-format water-Cherenkov shards from the ring simulator.

    python tools/make_lucid.py --out DIR --num-events N [--species electron muon] [--seed S]
        [--split train] [--events-per-file K] [--image-size H W] [--dataset-name wc] [--overwrite]

Writes, for each species, ``DIR/<species>/sensor/<name>_sensor_NNNN.h5`` and
``DIR/<species>/seg/<name>_seg_NNNN.h5`` (co-indexed: event i of a sensor shard
is event i of its segment shard; format in ``pimm/datasets/lucid_readers.py``).
``LUCiDDataset(data_root=DIR/<species>)`` reads one species;
``LUCiDEventSSLDataset(data_root=DIR, configs=[...species])`` reads them all,
labelled by species. Each event is a pure function of (seed, split, species,
index) (``pimm/datasets/lucid_generator.py``), so productions are reproducible.
Existing shards are never overwritten unless ``--overwrite`` is given, and
one run never writes a shard twice; ``--dataset-name`` is a plain file-name
prefix (no ``/`` or ``..``). Bad arguments print one ``error: ...`` line and
exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pimm.datasets.lucid_generator import SPECIES, check_dataset_name, generate_lucid  # noqa: E402
from pimm.utils.errors import UserError  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every pimm CLI
        raise UserError(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description="Generate LUCiD-format water-Cherenkov shards from the ring simulator.")
    p.add_argument("--out", required=True, help="output folder (one sub-folder per species)")
    p.add_argument("--num-events", type=int, required=True, help="events per species")
    p.add_argument("--species", nargs="+", default=list(SPECIES), help="electron and/or muon (default both)")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    p.add_argument("--split", default="train", help="generator stream: train, val or test (default train)")
    p.add_argument("--events-per-file", type=int, default=1000, help="events per shard (default 1000)")
    p.add_argument("--image-size", type=int, nargs=2, default=(32, 64), metavar=("H", "W"),
                   help="PMT grid on the barrel: z rows and phi columns (default 32 64)")
    p.add_argument("--dataset-name", default="wc", help="shard file prefix (default wc)")
    p.add_argument("--overwrite", action="store_true", help="replace existing shards")
    args = p.parse_args(argv)
    if args.num_events < 1:
        raise UserError(f"--num-events must be at least 1, got {args.num_events}")
    if args.events_per_file < 1:
        raise UserError(f"--events-per-file must be at least 1, got {args.events_per_file}")
    if args.seed < 0:
        raise UserError(f"--seed must be non-negative, got {args.seed}")
    unknown = [s for s in args.species if s not in SPECIES]
    if unknown:
        raise UserError(f"--species {unknown[0]!r} is not one of {', '.join(SPECIES)}")
    repeated = sorted({s for s in args.species if args.species.count(s) > 1})
    if repeated:
        raise UserError(f"--species names {repeated[0]!r} twice; each species is written once")
    try:
        check_dataset_name(args.dataset_name)
    except UserError as err:
        raise UserError(f"--dataset-name: {err}") from None
    if min(args.image_size) < 4 or max(args.image_size) > 4096:
        raise UserError(f"--image-size must be two numbers in [4, 4096], got {' '.join(map(str, args.image_size))}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        t0 = time.perf_counter()
        for species in args.species:
            generate_lucid(Path(args.out) / species, args.num_events, species, seed=args.seed, split=args.split,
                           dataset_name=args.dataset_name, events_per_file=args.events_per_file,
                           overwrite=args.overwrite, image_size=tuple(args.image_size))
    except (UserError, OSError) as err:  # OSError: unwritable folder, full disk
        if os.environ.get("PIMM_DEBUG") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.num_events} events of each of {', '.join(args.species)} to {args.out} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
