# upstream docs/source/extend/add_model.md, "Minimal segmentation model" (unmodified)
# pimm/models/my_segmentor.py
import torch.nn as nn

from pimm.models.builder import MODELS, build_model
from pimm.models.losses import build_criteria
from pimm.models.utils.structure import Point


@MODELS.register_module("MySegmentor")
class MySegmentor(nn.Module):
    def __init__(self, backbone, backbone_out_channels, num_classes, criteria):
        super().__init__()
        self.backbone = build_model(backbone)
        self.head = nn.Linear(backbone_out_channels, num_classes)
        self.criteria = build_criteria(criteria)

    def forward(self, input_dict, return_point=False):
        point = self.backbone(Point(input_dict))
        logits = self.head(point.feat)

        output = {"point": point} if return_point else {}
        if self.training:
            output["loss"] = self.criteria(logits, input_dict["segment"])
        elif "segment" in input_dict:
            output["loss"] = self.criteria(logits, input_dict["segment"])
            output["seg_logits"] = logits
        else:
            output["seg_logits"] = logits
        return output
