# Shared pieces of the LArTPC configs: the synthetic generator at its default
# settings (~2200 voxels per event in a 768^3 cube), log-energy as the input
# feature, optimizer and schedule. Models are in the configs that use it.
_base_ = "../_base_/default_runtime.py"

seed = 0
batch_size = 8
batch_size_val = 16
num_worker = 0

_transform = [
    dict(type="LogTransform", key="energy"),
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "segment", "instance"), feat_keys=("energy",)),
]
data = dict(
    train=dict(type="LArTPCSynthDataset", num_events=3000, split="train", transform=_transform, in_memory=True),
    val=dict(type="LArTPCSynthDataset", num_events=100, split="val", transform=_transform, in_memory=True),
    test=dict(type="LArTPCSynthDataset", num_events=200, split="test", transform=_transform),
)

optimizer = dict(type="AdamW", lr=3e-3, weight_decay=1e-4)
scheduler = dict(type="CosineWarmupLR", warmup_steps=50)
