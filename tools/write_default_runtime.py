"""Regenerate ``configs/_base_/default_runtime.py`` from the engine's runtime key
table (``pimm/engines/runtime.py``): ``python tools/write_default_runtime.py``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pimm.engines.runtime import render_default_runtime  # noqa: E402

if __name__ == "__main__":
    target = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "_base_",
                          "default_runtime.py")
    with open(target, "w") as fh:
        fh.write(render_default_runtime())
    print(f"wrote {target}")
