"""Event classification from a PMT response laid out on the detector's grid.

Water-Cherenkov PMTs sit on a regular grid of the barrel wall (z rows by phi
columns), so a point cloud of hit PMTs (``LUCiDEventSSLDataset`` items: one
point per hit PMT with ``sensor_idx``, ``energy`` in PE and ``time`` in ns)
is an image with most pixels empty. :class:`PMTGridClassifier` scatters each
event's hits back into that image -- ``log1p`` of the charge and the time
over ``time_scale`` as two channels, the layout of ``CherenkovRingDataset``
images -- and classifies it with :class:`~pimm.models.ring_cnn.RingCNN`
(circular padding along phi). The sensor index is the grid position
(``row * W + column``), as the LUCiD generator numbers its PMTs.
"""

from __future__ import annotations

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.config_domains import answers_with
from pimm.utils.domains import MAX_SIZE, Choice, Int, Key, Positive, Real, Seq, Size
from pimm.utils.errors import UserError

from .ring_cnn import RingCNN

__all__ = ["PMTGridClassifier"]


@MODELS.register_module()
class PMTGridClassifier(nn.Module):
    """Hit PMTs -> (B, 2, H, W) barrel image -> RingCNN logits.

    Args:
        grid: ``(H, W)`` PMT rows (z) and columns (phi); ``H * W`` sensors.
        num_classes: event classes.
        target_key: the per-event label key of the batch (``event_label``).
        time_scale: hit times (ns) are divided by this.
        width, depth, norm, dropout: the RingCNN's (see it).

    ``forward`` takes ``sensor_idx`` (N,), ``energy`` (N,1), ``time`` (N,1) and
    ``offset`` (B,); returns ``cls_logits`` (B, num_classes) and, when the
    batch has ``target_key``, the cross-entropy ``loss``.
    """

    domains = dict(grid=Seq(Int(1, 4096), length=2), num_classes=Int(2, MAX_SIZE), target_key=Key,
                   time_scale=Positive, width=Size, depth=Int(1, 64), norm=Choice("bn", "gn"),
                   dropout=Real(0, 1, hi_open=True))
    output_classes = answers_with("num_classes")  # the columns of cls_logits

    def __init__(self, grid=(32, 64), num_classes: int = 2, target_key: str = "event_label",
                 time_scale: float = 20.0, width: int = 16, depth: int = 3, norm: str = "bn",
                 dropout: float = 0.0):
        super().__init__()
        self.grid = (int(grid[0]), int(grid[1]))
        self.target_key, self.time_scale = target_key, float(time_scale)
        self.cnn = RingCNN(in_channels=2, num_classes=num_classes, width=width, depth=depth, norm=norm,
                           dropout=dropout)

    def image(self, input_dict: dict) -> torch.Tensor:
        """The (B, 2, H, W) charge / time image of every event of the batch."""
        sensor = input_dict["sensor_idx"].reshape(-1).long()
        offset = input_dict["offset"].reshape(-1).long()
        height, width = self.grid
        if sensor.numel() and int(sensor.max()) >= height * width:
            raise UserError(f"PMTGridClassifier: a hit names sensor {int(sensor.max())} but grid={self.grid} has "
                            f"{height * width}; set model.grid to the detector's PMT rows and columns")
        counts = torch.diff(offset, prepend=offset.new_zeros(1))
        event = torch.repeat_interleave(torch.arange(len(offset), device=offset.device), counts)
        energy = input_dict["energy"].reshape(-1).float()
        time = input_dict["time"].reshape(-1).float()
        img = energy.new_zeros(len(offset), 2, height * width)
        img[event, 0, sensor] = torch.log1p(energy.clamp_min(0))
        img[event, 1, sensor] = time / self.time_scale
        return img.view(len(offset), 2, height, width)

    def forward(self, input_dict: dict) -> dict:
        inputs = {"img": self.image(input_dict)}
        if self.target_key in input_dict:
            inputs["label"] = input_dict[self.target_key].reshape(-1)
        return self.cnn(inputs)
