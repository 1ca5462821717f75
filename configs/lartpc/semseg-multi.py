# MultiDatasetTrainer: mix the default generator settings with a denser,
# shower-heavy variant (75 % / 25 %), fixed epoch length, exactly resumable.
# data.train may also list a PILArNetH5Dataset(data_root=...) next to a generator.
_base_ = "semseg-sparseunet.py"

save_path = "exp/lartpc/semseg-multi"
train = dict(type="MultiDatasetTrainer", ratios=[0.75, 0.25], samples_per_epoch=3000)
_t = [
    dict(type="LogTransform", key="energy"),
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "segment", "instance"), feat_keys=("energy",)),
]
data = dict(
    train=[
        dict(type="LArTPCSynthDataset", num_events=2400, split="train", transform=_t, in_memory=True),
        dict(type="LArTPCSynthDataset", num_events=600, seed=1, split="train", transform=_t, in_memory=True,
             points_per_event=(2500, 4000)),
    ],
)
