# Semantic segmentation of synthetic LArTPC events (shower / track / Michel /
# delta / low-energy) with a pure-PyTorch submanifold sparse U-Net.
_base_ = "_base_lartpc.py"

save_path = "exp/lartpc/semseg-sparseunet"
epoch = 5
train = dict(type="DefaultTrainer")
model = dict(type="DefaultSegmentor", num_classes=5,
             backbone=dict(type="SparseUNet", in_channels=1, grid_size=1.0, channels=(16, 32, 48, 64, 96),
                           enc_blocks=(1, 1, 1, 1, 1), dec_blocks=(1, 1, 1, 1)),
             criteria=[dict(type="CrossEntropyLoss", ignore_index=-1), dict(type="LovaszLoss", ignore_index=-1)])
# The runtime services come from the base's default_hooks (docs/hooks.md).
default_hooks = dict(information_writer=dict(log_frequency=50), checkpoint=dict(save_freq=500))
hooks = [
    dict(type="SemSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"]),
]
