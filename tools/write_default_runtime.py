"""Regenerate the runtime base, ``pimm/configs/_base_/default_runtime.py``, from the
engine's runtime key table (``pimm/engines/run/runtime.py``): ``python tools/write_default_runtime.py``.
(``configs/_base_/default_runtime.py`` in the repository only points at it.)"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pimm.engines.run.runtime import render_default_runtime  # noqa: E402

if __name__ == "__main__":
    target = os.path.join(ROOT, "pimm", "configs", "_base_", "default_runtime.py")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w") as fh:
        fh.write(render_default_runtime())
    print(f"wrote {target}")
