# upstream docs/source/extend/add_transform.md, "Skeleton" (unmodified)
import numpy as np

from pimm.datasets.transform import TRANSFORMS


@TRANSFORMS.register_module()
class RandomEnergyDropout:
    def __init__(self, ratio=0.1, p=0.5):
        self.ratio = float(ratio)
        self.p = float(p)

    def __call__(self, data_dict):
        if "energy" not in data_dict or np.random.rand() >= self.p:
            return data_dict
        mask = np.random.rand(len(data_dict["energy"])) < self.ratio
        data_dict["energy"][mask] = 0.0
        return data_dict
