"""bench/gpu_check.py runs end to end without a GPU: every CUDA row is
skipped with its one-line reason, the sparse U-Net row runs on the CPU."""

import subprocess
import sys

import pytest
import torch

from tests.support.run import ROOT, env

CUDA_ROWS = ["step-mlp", "step-ring", "amp-bf16", "amp-fp16", "resume-cuda", "fsdp2-1gpu", "sync-debug"]


@pytest.mark.slow  # ~60 s on a loaded 2-core machine (the sparse U-Net row)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path; on a GPU run bench/gpu_check.py itself")
def test_gpu_check_runs_on_cpu_with_reasoned_skips():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--quick"], capture_output=True,
                          text=True, env=env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[2:] if line.strip()}
    assert set(rows) == {*CUDA_ROWS, "sparse-unet"}
    for name in CUDA_ROWS:
        assert rows[name].split()[1] == "skipped" and "no CUDA device" in rows[name], rows[name]
    sparse = rows["sparse-unet"]
    assert sparse.split()[1] == "ok" and "CPU: reference" in sparse and "memory_ratio" in sparse, sparse
    ratio = float(sparse.split("memory_ratio ")[1].split(")")[0])
    assert 0 < ratio < 0.6  # the current convolution keeps no per-pair copy of its input
