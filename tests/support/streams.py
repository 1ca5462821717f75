"""A finite, rank-sharded stream (imported via ``custom_imports``), like the
sharded parquet/HDF5 streams of upstream pimm: ``num_samples()`` is the size
of the whole stream and each process reads its own share of it."""

import torch

from pimm.engines import DATASETS
from pimm.utils import comm


@DATASETS.register_module(force=True)
class ToyShardedStream(torch.utils.data.IterableDataset):
    """``length`` samples per epoch in all; rank r reads samples r, r + W, ...
    (``length // W`` of them) and then stops: asking for more runs out, as a
    file-backed shard does. Sample k of epoch e is drawn from a generator seeded
    by (e, k); ``position`` (samples this rank has read) is its resumable state."""

    def __init__(self, length=80, dim=8):
        self.length, self.dim, self.position = length, dim, 0
        self.weights = torch.randn(dim, generator=torch.Generator().manual_seed(1234))

    def num_samples(self):
        return self.length

    def __iter__(self):
        rank, world = comm.get_rank(), comm.get_world_size()
        quota = self.length // world
        end = (self.position // quota + 1) * quota  # the end of the current epoch's shard
        while self.position < end:
            epoch, index = divmod(self.position, quota)
            x = torch.randn(self.dim, generator=torch.Generator().manual_seed(epoch * 1_000_003 + index * world + rank))
            self.position += 1
            yield {"x": x, "label": (x @ self.weights > 0).long(), "rank": rank}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]
