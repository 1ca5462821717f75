"""A hook that holds training at chosen steps until a pre-emption signal has
arrived, so a test can pre-empt a real multi-process run at a known step
(imported via ``custom_imports``).

At each step in ``steps`` every rank starts listening for ``signals``
(chaining to the engine's own handler, which still sets its flag), the ranks
meet at a barrier, rank 0 creates ``directory/paused-<step>`` (holding the
``SLURM_*`` and ``TORCHELASTIC_*`` variables it sees, as JSON), and each rank
waits until the signal has reached it. The test sees the file, sends the
signal its own way (SLURM, torchrun, ...) and the run stops at the next
step where the ranks agree on pre-emption. Without the barrier a signal sent
on rank 0's word could reach a rank before it listened.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from pimm.engines import HOOKS, HookBase
from pimm.utils import comm

__all__ = ["PauseForSignal"]


@HOOKS.register_module(force=True)
class PauseForSignal(HookBase):
    priority = "LOWEST"

    def __init__(self, steps=(), directory=".", signals=("SIGTERM", "SIGUSR2"), timeout_s=120.0):
        self.steps, self.directory = set(steps), Path(directory)
        self.signals, self.timeout_s = list(signals), float(timeout_s)

    def after_step(self):
        step = self.trainer.global_step
        if step not in self.steps:
            return
        received = []
        previous = {}
        for name in self.signals:
            signum = getattr(signal, name)
            previous[signum] = signal.getsignal(signum)

            def listen(sig, frame, chained=previous[signum]):
                received.append(sig)
                if callable(chained):
                    chained(sig, frame)

            signal.signal(signum, listen)
        try:
            comm.synchronize()
            if comm.is_main_process():
                self.directory.mkdir(parents=True, exist_ok=True)
                seen = {k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "TORCHELASTIC_"))}
                (self.directory / f"paused-{step}").write_text(json.dumps(seen))
            deadline = time.monotonic() + self.timeout_s
            while not received:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"PauseForSignal: no {'/'.join(self.signals)} within {self.timeout_s:.0f}s "
                                       f"at step {step}")
                time.sleep(0.05)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
