"""One intra-op thread in every test process.

The suite runs three pytest workers on two cores, and most tests start more
processes beside them. With torch's default of one thread per core, every
parallel op of an in-process test waits for the other thread's time slice
while the cores are busy: a 5-second model fit took 57 seconds in the slow
tier. Subprocesses already get ``OMP_NUM_THREADS=1`` (tests/support/run.py);
this gives the workers themselves, and anything they start, the same.
A test that needs more threads sets them itself (and restores them).
"""

import os

import torch

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no pool of compile-worker interpreters
torch.set_num_threads(1)


# --------------------------------------------------------------------------- scheduling under -n N
#
# pytest-xdist runs with --dist loadfile (pyproject.toml): a test file's tests
# stay on one worker, so its module fixtures (often a reference training run)
# are built once. Files start in the order below (--no-loadscope-reorder,
# else xdist starts the files with the most tests first): the longest first,
# so that none starts last and leaves the other workers idle (worker-seconds
# from --durations=0, 2026-12-07).
LONGEST_FIRST = (
    # fast tier: the domain sweep's module fixture (~34 s), then the command-line error table
    "test_domains.py", "test_cli_errors.py",
    # slow tier: ~170 s down to ~25 s of one worker each
    "test_upstream_semseg_configs.py", "test_launch_cli.py", "test_readme.py", "test_interrupt.py",
    "test_hardening_r6_records.py", "test_multinode.py", "test_slurm.py", "test_fsdp.py", "test_lr_control.py",
    "test_sonata_train.py", "test_own_data.py", "test_grpo_e2e.py", "test_ptv3_train.py", "test_lartpc_trainers.py",
)


def pytest_collection_modifyitems(config, items):
    first = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: files keep their own order
