# Semantic segmentation of synthetic LArTPC events with Point Transformer V3
# (PT-v3m2, the Sonata variant) under upstream's DefaultSegmentorV2.
#
#   python tools/train.py --config-file configs/lartpc/semseg-ptv3.py
#
# On a loaded machine prefix OMP_NUM_THREADS=1: with two threads every
# parallel op waits for the other thread's time slice (docs/models/ptv3.md,
# "Speed on CPU").
#
# Level 0 is 16 wide with one head (the sparse U-Net's level-0 width): a
# step costs ~1.43x the U-Net's (bench/ptv3.py --rounds 7 --compare
# configs/lartpc/semseg-sparseunet.py, 2026-12-07, load 6) against ~2.1-2.2x
# at width 32. AdamW runs its fused kernel (1.0 against 5.5 ms a step).
#
# Measured on the quiet VM, 2026-12-07 11:20-11:36 UTC (load 1.5-2, torch's
# two threads): val mIoU 0.592 / 0.676 / 0.763 / 0.806 / 0.813 / 0.846 /
# 0.862 / 0.868 after 250 / 500 / ... / 2,000 steps (IoU shower 0.924, track
# 0.919, Michel 0.873, delta 0.630, low-energy 0.996), 16 min 14 s for the
# whole command (16 min 51 s in a second quiet run at 13:34 UTC; 22 min 24 s
# under load 3-7; the same curve each time). The same recipe
# over 3,000 steps (--options data.train.num_events=24000) reached 0.887 in
# 23 min 50 s, past the 20 minutes. The 0.90 target is not reached; neither
# a higher or lower peak lr, patches of 128 nor the U-Net's data recipe moved
# a 600-step run beyond the noise (docs/models/ptv3.md, "Applied since, and
# the recipe").
#
# One pass over 16,000 events (2,000 steps of 8) generated on the fly by one
# loader worker (generation, ~6 ms an event, overlaps the steps), evaluation
# every 250 steps.
_base_ = "_base_lartpc.py"

save_path = "exp/lartpc/semseg-ptv3"
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
data = dict(train=dict(transform=_transform, num_events=16000, in_memory=False), val=dict(transform=_transform),
            test=dict(transform=_transform))

model = dict(
    type="DefaultSegmentorV2",
    num_classes=5,
    backbone_out_channels=16,
    backbone=dict(
        type="PT-v3m2",
        in_channels=4,
        order=("z", "z-trans", "hilbert", "hilbert-trans"),
        stride=(2, 2, 2),
        enc_depths=(1, 1, 1, 1),
        enc_channels=(16, 32, 64, 96),
        enc_num_head=(1, 2, 4, 6),
        enc_patch_size=(64, 64, 64, 64),
        dec_depths=(1, 1, 1),
        dec_channels=(16, 32, 64),
        dec_num_head=(1, 2, 4),
        dec_patch_size=(64, 64, 64),
        mlp_ratio=2,
        drop_path=0.0,
        shuffle_orders=True,
        enable_rpe=False,
        enable_flash=True,  # fixed patches through scaled_dot_product_attention (no flash-attn needed)
        upcast_attention=False,
        upcast_softmax=False,
    ),
    criteria=[dict(type="CrossEntropyLoss", ignore_index=-1), dict(type="LovaszLoss", ignore_index=-1)],
)
optimizer = dict(type="AdamW", lr=3e-3, weight_decay=0.05, fused=True)
scheduler = dict(type="CosineWarmupLR", warmup_steps=50)
# The runtime services come from the base's default_hooks (docs/hooks.md).
default_hooks = dict(information_writer=dict(log_frequency=50), checkpoint=dict(save_freq=500, save_every_minutes=2))  # steps are long: bound the loss in time too
hooks = [
    dict(type="SemSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"],
         every_n_steps=250),
]
