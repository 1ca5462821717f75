# upstream docs/source/extend/add_dataset.md, "Interface" (unmodified)
from pathlib import Path

import torch

from pimm.datasets.builder import DATASETS
from pimm.datasets.transform import Compose


@DATASETS.register_module()
class MyDataset(torch.utils.data.Dataset):
    def __init__(self, data_root, split="train", transform=None):
        self.transform = Compose(transform)
        self.data_list = sorted((Path(data_root) / split).glob("*.npz"))

    def get_data(self, index):
        raise NotImplementedError("decode one indexed event here")

    def __getitem__(self, index):
        return self.transform(self.get_data(index))

    def __len__(self):
        return len(self.data_list)
