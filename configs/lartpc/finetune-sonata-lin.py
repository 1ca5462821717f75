# Stage 2 of docs/pretraining.md: semantic segmentation from 1% of the labels
# (30 labelled events) on top of the encoder pre-trained by
# configs/lartpc/pretrain-sonata.py, frozen, with a linear head on every
# level's features (upstream's "lin" recipe).
#
#   python tools/train.py --config-file configs/lartpc/finetune-sonata-lin.py \
#       --options weight=exp/lartpc/pretrain-sonata/model/model_last.pth
#
# The full fine-tune and the from-scratch baseline: finetune-sonata-fft.py.
_base_ = "../_base_/default_runtime.py"

save_path = "exp/lartpc/finetune-sonata-lin"
seed = 0
# 100 epochs (700 steps): a linear head on frozen features learns slowly (140
# steps leave it well short of what the features allow), and each step costs a
# fraction of a full fine-tune's, so this takes about the scratch baseline's time.
epoch = 100
eval_epoch = 4  # evaluate every 25 epochs
batch_size = 4
batch_size_val = 8
num_worker = 0

_grid_size = 0.001
model = dict(
    type="DefaultSegmentorV2",
    num_classes=5,
    backbone_out_channels=32 + 48 + 64 + 96,
    backbone=dict(
        type="PT-v3m2",
        in_channels=4,
        order=("z", "z-trans", "hilbert", "hilbert-trans"),
        stride=(2, 2, 2),
        enc_depths=(1, 1, 1, 1),
        enc_channels=(32, 48, 64, 96),
        enc_num_head=(2, 3, 4, 6),
        enc_patch_size=(64, 64, 64, 64),
        mlp_ratio=2,
        layer_scale=1e-5,
        drop_path=0.0,
        shuffle_orders=True,
        enable_rpe=False,
        enable_flash=True,
        traceable=True,
        enc_mode=True,
    ),
    criteria=[dict(type="CrossEntropyLoss", ignore_index=-1)],
    freeze_backbone=True,
)
optimizer = dict(type="AdamW", lr=1e-2, weight_decay=0.01)
scheduler = dict(type="OneCycleLR", max_lr=1e-2, pct_start=0.05, anneal_strategy="cos", div_factor=10.0,
                 final_div_factor=1000.0)

_normalise = [
    dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=768.0 * 3**0.5 / 2),
    dict(type="GridSample", grid_size=_grid_size, hash_type="fnv", mode="train", return_grid_coord=True),
    dict(type="LogTransform", min_val=0.01, max_val=20.0, keys=("energy",)),
    dict(type="CenterShift", axes=("x", "y", "z")),
]
_augment = [
    dict(type="RandomRotate", angle=[-1, 1], axis="z", center=[0, 0, 0], p=0.8),
    dict(type="RandomRotate", angle=[-1, 1], axis="x", center=[0, 0, 0], p=0.8),
    dict(type="RandomRotate", angle=[-1, 1], axis="y", center=[0, 0, 0], p=0.8),
    dict(type="RandomFlip", p=0.5, axes=("x", "y", "z")),
]
_pack = [
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "grid_coord", "segment"), feat_keys=("coord", "energy")),
]
data = dict(
    num_classes=5,
    ignore_index=-1,
    names=["shower", "track", "michel", "delta", "low_energy"],
    # 1% of the labels: 30 events of the split the encoder was pre-trained on (without their labels)
    train=dict(type="LArTPCSynthDataset", num_events=30, split="train", transform=_normalise + _augment + _pack,
               in_memory=True),
    val=dict(type="LArTPCSynthDataset", num_events=100, split="val", transform=_normalise + _pack, in_memory=True),
)

# The pre-trained student's backbone is loaded into this model's backbone by the
# default checkpoint loader, with upstream's keyword replacement.
default_hooks = dict(
    checkpoint_loader=dict(keywords="module.student.backbone", replacement="module.backbone", strict=False),
    information_writer=dict(log_frequency=10),
)
hooks = [dict(type="SemSegEvaluator", write_cls_iou=True)]
