# Instance segmentation (particles) of synthetic LArTPC events with upstream's
# PointGroup (PG-v1m1) on upstream's spconv U-Net (SpUNet-v1m1), both in pure
# PyTorch: per-point classes and centroid offsets, then upstream's clustering
# (balls of cluster_thresh voxels around the shifted points, same-class
# components) at evaluation. docs/models.md, "PG-v1m1".
#
#   python tools/train.py --config-file configs/lartpc/inseg-pg-v1m1.py
#
# A small model for the CPU; not tuned (PointGroupLite's config,
# inseg-pointgroup.py, is the tuned instance model).
_base_ = "_base_lartpc.py"

save_path = "exp/lartpc/inseg-pg-v1m1"
epoch = 5
train = dict(type="InsegTrainer")

# One voxel per grid cell (the generator's voxels are distinct); coordinates
# in units of 50 voxels, so a voxel is 0.02 as in upstream's scenes (its
# default voxel_size) and offsets are O(1); InstanceParser then writes
# instance_centroid, the offset target. Low-energy deposits (class 4) are
# stuff: no instance, never clustered.
_transform = [
    dict(type="GridSample", grid_size=1.0, hash_type="fnv", mode="train", return_grid_coord=True),
    dict(type="NormalizeCoord", center=[0.0, 0.0, 0.0], scale=50.0),
    dict(type="InstanceParser", segment_ignore_index=(-1, 4)),
    dict(type="LogTransform", key="energy"),
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "grid_coord", "segment", "instance", "instance_centroid"),
         feat_keys=("energy",)),
]
data = dict(train=dict(transform=_transform), val=dict(transform=_transform), test=dict(transform=_transform))

model = dict(
    type="PG-v1m1",
    backbone=dict(type="SpUNet-v1m1", in_channels=1, num_classes=0, base_channels=16,
                  channels=(16, 32, 48, 64, 48, 32, 32, 32), layers=(1, 1, 1, 1, 1, 1, 1, 1)),
    backbone_out_channels=32,
    semantic_num_classes=5,
    semantic_ignore_index=-1,
    segment_ignore_index=(-1, 4),
    instance_ignore_index=-1,
    # balls of 1.5 voxels around the shifted points
    voxel_size=0.02,
    cluster_thresh=1.5,
    cluster_closed_points=300,
    cluster_propose_points=5,
    cluster_min_points=5,
)
# The runtime services come from the base's default_hooks (docs/hooks.md).
default_hooks = dict(information_writer=dict(log_frequency=50), checkpoint=dict(save_freq=500, save_every_minutes=5))
hooks = [
    dict(type="InsSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"]),
    dict(type="SemSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"]),
]
