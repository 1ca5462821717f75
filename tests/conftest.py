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
