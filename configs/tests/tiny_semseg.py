# The smallest real run: a two-level PT-v3 segmenting PILArNet events into five
# classes for one epoch, on CPU, in seconds (the model upstream pimm's
# configs/tests/tiny_semseg.py trains, on pimm's runtime defaults). The first
# command of upstream's README checks it without data:
#
#   pimm launch --train.config tests/tiny_semseg --resources.nproc-per-node 1 --dry-run
#
# and with PILArNet files (data_root None reads $PILARNET_DATA_ROOT_V2; make
# small ones with tools/export_pilarnet.py) it trains:
#
#   pimm launch --train.config tests/tiny_semseg --resources.nproc-per-node 1 -- epoch=2 use_wandb=False
_base_ = ["../_base_/default_runtime.py"]

seed = 0
epoch = 1
eval_epoch = 1
batch_size = 4
batch_size_val = 1
batch_size_test = 1
num_worker = 0
use_wandb = False
enable_amp = False
matmul_precision = "high"

class_names = ["shower", "track", "michel", "delta", "led"]

model = dict(
    type="DefaultSegmentorV2",
    num_classes=len(class_names),
    backbone_out_channels=8,
    backbone=dict(
        type="PT-v3m2",
        in_channels=4,  # x, y, z and log energy
        order=("z",),
        stride=(2,),
        enc_depths=(1, 1),
        enc_channels=(8, 16),
        enc_num_head=(1, 2),
        enc_patch_size=(32, 32),
        dec_depths=(1,),
        dec_channels=(8,),
        dec_num_head=(1,),
        dec_patch_size=(32,),
        mlp_ratio=2,
        drop_path=0.0,
        shuffle_orders=False,
        enable_rpe=False,
        enable_flash=False,
        enable_cpe=True,
        upcast_attention=True,
        upcast_softmax=True,
        enc_mode=False,
    ),
    criteria=[dict(type="CrossEntropyLoss", loss_weight=1.0, ignore_index=-1)],
)

optimizer = dict(type="AdamW", lr=1e-3, weight_decay=0.01)
scheduler = dict(type="OneCycleLR", max_lr=1e-3, pct_start=0.1, anneal_strategy="cos", div_factor=10.0,
                 final_div_factor=100.0)

# PILArNet coordinates span a 768-voxel cube: centre it and scale it to the unit ball.
_transform = [
    dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=768.0 * 3**0.5 / 2),
    dict(type="LogTransform", min_val=0.01, max_val=20.0),
    dict(type="GridSample", grid_size=0.001, hash_type="fnv", mode="train", return_grid_coord=True),
    dict(type="Copy", keys_dict={"segment_motif": "segment"}),
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "grid_coord", "segment"), feat_keys=("coord", "energy")),
]
_events = dict(type="PILArNetH5Dataset", data_root=None, revision="v2", transform=_transform, min_points=0)

data = dict(
    num_classes=len(class_names),
    ignore_index=-1,
    names=class_names,
    train=dict(_events, split="train", max_len=80),
    val=dict(_events, split="val", max_len=20),
)

# The runtime services (checkpoint loading and saving, timing, logging) come from the base's
# default_hooks; this run times every step and adds the segmentation evaluator (docs/hooks.md).
default_hooks = dict(timer=dict(warmup_iter=0))
hooks = [dict(type="SemSegEvaluator")]

test = dict(type="SemSegTester", verbose=False)
