# Semantic segmentation of synthetic LArTPC events with upstream's spconv
# U-Net (SpUNet-v1m1) on pimm's pure-PyTorch sparse convolution, under
# upstream's DefaultSegmentor: no num_classes there, the backbone's 1x1
# convolution gives the class logits (so upstream SpUNet checkpoints load
# strictly). Small widths: a step costs about 1.45x a SparseUNet step
# (bench/model_zoo.py, docs/models.md).
#
#   python tools/train.py --config-file configs/lartpc/semseg-spunet.py
#
# Measured (2026-12-07, OMP_NUM_THREADS=1, 2 cores shared with other jobs, load 3-8): val mIoU
# 0.908 after the 5 epochs (0.638 / 0.788 / 0.887 / 0.909 / 0.908 per epoch), 47 min 47 s for the command.
#
# A MinkowskiEngine U-Net trains through the same file (docs/models.md):
#   --options "model.backbone=dict(type='MinkUNet14A', in_channels=1, out_channels=5)"
_base_ = "_base_lartpc.py"

save_path = "exp/lartpc/semseg-spunet"
epoch = 5
train = dict(type="DefaultTrainer")

# One point per voxel (the generator's voxels are distinct): grid_coord from GridSample at the voxel size.
_transform = [
    dict(type="GridSample", grid_size=1.0, hash_type="fnv", mode="train", return_grid_coord=True),
    dict(type="LogTransform", key="energy"),
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "grid_coord", "segment", "instance"), feat_keys=("energy",)),
]
data = dict(train=dict(transform=_transform), val=dict(transform=_transform), test=dict(transform=_transform))

model = dict(type="DefaultSegmentor",
             backbone=dict(type="SpUNet-v1m1", in_channels=1, num_classes=5, base_channels=16,
                           channels=(32, 48, 64, 96, 64, 48, 32, 32), layers=(1, 1, 1, 1, 1, 1, 1, 1)),
             criteria=[dict(type="CrossEntropyLoss", ignore_index=-1), dict(type="LovaszLoss", ignore_index=-1)])
# The runtime services come from the base's default_hooks (docs/hooks.md).
default_hooks = dict(information_writer=dict(log_frequency=50), checkpoint=dict(save_freq=500))
hooks = [
    dict(type="SemSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"]),
]
