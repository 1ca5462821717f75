# Instance segmentation (particles) of synthetic LArTPC events: SparseUNet +
# semantic head + centroid-offset head, clustered at evaluation (PointGroupLite).
_base_ = "_base_lartpc.py"

save_path = "exp/lartpc/inseg-pointgroup"
epoch = 5
train = dict(type="InsegTrainer")
model = dict(type="PointGroupLite", num_classes=5, stuff_classes=(4,),
             backbone=dict(type="SparseUNet", in_channels=1, grid_size=1.0, channels=(16, 32, 48, 64, 96, 128),
                           enc_blocks=(1, 1, 1, 1, 1, 1), dec_blocks=(1, 1, 1, 1, 1)),
             criteria=[dict(type="CrossEntropyLoss", ignore_index=-1), dict(type="LovaszLoss", ignore_index=-1)],
             # offsets regressed in units of 50 voxels; clustering radii per class
             # (shower, track, Michel, delta, low-energy), as tuned in docs/models.md
             offset_scale=50.0, offset_weight=1.0, direction_weight=1.0,
             agree_radius=(6.0, 3.0, 4.0, 4.0, 3.0), merge_radius=(35.0, 10.0, 10.0, 10.0, 10.0))
# The runtime services come from the base's default_hooks (docs/hooks.md).
default_hooks = dict(information_writer=dict(log_frequency=50), checkpoint=dict(save_freq=500, save_every_minutes=5))
hooks = [
    dict(type="InsSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"]),
    dict(type="SemSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"]),
]
