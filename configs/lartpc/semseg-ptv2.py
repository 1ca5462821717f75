# Semantic segmentation of synthetic LArTPC events with Point Transformer V2
# (PT-v2m2, upstream's recommended variant), written as upstream writes it:
# upstream's DefaultSegmentor (no num_classes, no head) over a backbone that
# predicts the logits itself (num_classes=5), so a checkpoint of this model
# has upstream's layout (backbone.* only) and loads into upstream's code and back.
#
#   python tools/train.py --config-file configs/lartpc/semseg-ptv2.py
#
# Point Transformer v1 trains on the same data with the option
#   model.backbone='dict(type="PointTransformer-Seg26",in_channels=4,num_classes=5)'
# (its widths are fixed; every event needs >= 256 points, which the generator's always have).
#
# Grid sizes are in the normalised coordinates below (one voxel = 1/665):
# 3, 6, 12 and 24 voxels. Step times: docs/models.md (bench/model_zoo.py).
_base_ = "_base_lartpc.py"

save_path = "exp/lartpc/semseg-ptv2"
epoch = 1
batch_size = 8
num_worker = 1

# Voxel-unit coordinates: one voxel per grid cell (the generator's voxels are
# distinct), then coordinates into about [-1, 1] and log energy as features.
_transform = [
    dict(type="GridSample", grid_size=1.0, hash_type="fnv", mode="train", return_grid_coord=True),
    dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=768.0 * 3**0.5 / 2),
    dict(type="LogTransform", key="energy"),
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "grid_coord", "segment", "instance"), feat_keys=("coord", "energy")),
]
data = dict(train=dict(transform=_transform, in_memory=False), val=dict(transform=_transform),
            test=dict(transform=_transform))

model = dict(
    type="DefaultSegmentor",
    backbone=dict(
        type="PT-v2m2",
        in_channels=4,
        num_classes=5,
        patch_embed_depth=1,
        patch_embed_channels=16,
        patch_embed_groups=2,
        patch_embed_neighbours=8,
        enc_depths=(1, 1, 2, 1),
        enc_channels=(32, 48, 64, 96),
        enc_groups=(4, 6, 8, 12),
        enc_neighbours=(16, 16, 16, 16),
        dec_depths=(1, 1, 1, 1),
        dec_channels=(16, 32, 48, 64),
        dec_groups=(2, 4, 6, 8),
        dec_neighbours=(16, 16, 16, 16),
        grid_sizes=(3 / 665, 6 / 665, 12 / 665, 24 / 665),
        attn_qkv_bias=True,
        pe_multiplier=False,
        pe_bias=True,
        attn_drop_rate=0.0,
        drop_path_rate=0.1,
        enable_checkpoint=False,
        unpool_backend="map",
    ),
    criteria=[dict(type="CrossEntropyLoss", ignore_index=-1), dict(type="LovaszLoss", ignore_index=-1)],
)
optimizer = dict(type="AdamW", lr=3e-3, weight_decay=0.05)
scheduler = dict(type="CosineWarmupLR", warmup_steps=50)
default_hooks = dict(information_writer=dict(log_frequency=50), checkpoint=dict(save_freq=200, save_every_minutes=2))
hooks = [
    dict(type="SemSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"],
         every_n_steps=150),
]
