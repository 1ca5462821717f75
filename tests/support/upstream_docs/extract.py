"""Regenerate ``snippets.json``: the Python blocks of upstream pimm's docs that
load a released model, byte for byte (gregorkrz/particle-imaging-models at
commit 9b4950f61c61571af9b22dafd621b0d4d68c2b92). They stand for what a user
copies from those pages; ``tests/test_from_pretrained_upstream.py`` runs them.

    python tests/support/upstream_docs/extract.py /path/to/particle-imaging-models/.git
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

COMMIT = "9b4950f61c61571af9b22dafd621b0d4d68c2b92"
#: (page, the block's key in snippets.json, a string that picks the block).
BLOCKS = [
    ("README.md", "readme_run_a_released_model", '"DeepLearnPhysics/PoLAr-MAE-Semantic"'),
    ("docs/source/tutorials/explore_panda.md", "explore_panda_semantic", '"DeepLearnPhysics/Panda-Semantic"'),
    ("docs/source/tutorials/explore_panda.md", "explore_panda_base", '"DeepLearnPhysics/Panda-Base"'),
    ("docs/source/tutorials/explore_panda.md", "explore_panda_particle", '"DeepLearnPhysics/Panda-Particle"'),
    ("docs/source/tutorials/explore_panda.md", "explore_panda_interaction", '"DeepLearnPhysics/Panda-Interaction"'),
    ("docs/source/models/pretrained.md", "pretrained_backbone_by_model_type", 'model_type="PT-v3m2"'),
    ("docs/source/models/pretrained.md", "pretrained_metadata", '"DeepLearnPhysics/Panda-Semantic",\n    strict=False'),
    ("docs/source/models/export.md", "export_push_to_hub", "from pimm.export import push_to_hub"),
]


def main(git_dir: str) -> None:
    snippets = {"commit": COMMIT}
    for page, key, marker in BLOCKS:
        text = subprocess.run(["git", "--git-dir", git_dir, "show", f"{COMMIT}:{page}"], check=True,
                              capture_output=True, text=True).stdout
        blocks = [b for b in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M) if marker in b]
        assert len(blocks) == 1, (page, marker, len(blocks))
        snippets[key] = {"page": page, "code": blocks[0]}
    out = Path(__file__).with_name("snippets.json")
    out.write_text(json.dumps(snippets, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1])
