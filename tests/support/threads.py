"""``single_thread``: an autouse fixture for test modules on tiny tensors.

Import it into a test module (``from tests.support.threads import
single_thread``) to run that module's tests on one thread: OpenMP with two
threads stalls when the 2-core machine is busy, and the previous setting is
restored afterwards for other modules.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
