"""A model torch.compile cannot capture whole: its forward branches on a
tensor's value (``.item()``), a graph break, which ``fullgraph=True`` refuses."""

from torch import nn

from pimm.engines.registries import MODELS


@MODELS.register_module(force=True)
class BranchyMLP(nn.Module):
    def __init__(self, dim=8, num_classes=2):
        super().__init__()
        self.net = nn.Linear(dim, num_classes)

    def forward(self, batch):
        x = batch["x"]
        if x.sum().item() > 0:  # data-dependent Python control flow
            x = x * 2
        logits = self.net(x)
        return {"cls_logits": logits, "loss": nn.functional.cross_entropy(logits, batch["label"])}
