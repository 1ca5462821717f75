"""bench/ptv3_upstream.py times upstream's own PT-v3 in a scratch venv; pimm
does not depend on it, so without that venv the bench says so in one line
and exits 0 (it never reaches for upstream's packages in pimm's venv)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_upstream_bench_skips_in_one_line_without_the_scratch_venv(tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "ptv3_upstream.py"), "--upstream-python",
                           str(missing)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"skipped: {missing} is missing (upstream's scratch venv and git mirror, "
                                        f"see the docstring)"]
    assert done.stderr == ""
