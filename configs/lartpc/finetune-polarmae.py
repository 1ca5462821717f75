# PoLAr-MAE semantic segmentation from 1% of the labels (the same 30 labelled
# events and 100 validation events as finetune-sonata-*.py), full fine-tune of
# the encoder pre-trained by configs/lartpc/pretrain-polarmae.py (upstream's
# configs/polarmae/semseg/semseg-polarmae-pilarnet-fft.py recipe, small).
#
#   python tools/train.py --config-file configs/lartpc/finetune-polarmae.py \
#       --options weight=exp/lartpc/pretrain-polarmae/model/model_last.pth
#   python tools/train.py --config-file configs/lartpc/finetune-polarmae.py \
#       --options save_path=exp/lartpc/finetune-polarmae-scratch      # baseline
_base_ = "../_base_/default_runtime.py"

save_path = "exp/lartpc/finetune-polarmae"
seed = 0
epoch = 20
eval_epoch = 4  # evaluate every 5 epochs
batch_size = 4
batch_size_val = 8
num_worker = 0

_scale = 768 * 3**0.5 / 2
_transformer = dict(embed_dim=96, depth=4, num_heads=4, mlp_ratio=2.0, postnorm=False, add_pos_at_every_layer=True,
                    drop_rate=0.0, attn_drop_rate=0.05, drop_path_rate=0.1)
model = dict(
    type="PoLArMAE-SemSeg",
    num_classes=5,
    arch="vit_tiny",
    voxel_size=5,
    num_channels=4,
    seg_head_fetch_layers=[1, 3],
    seg_head_combination_method="mean",
    seg_head_dim=128,
    seg_head_dropout=0.5,
    freeze_encoder=False,
    apply_encoder_postnorm=False,
    condition_global_features=True,
    upsampling_k=5,
    center=[0.0, 0.0, 0.0],  # the transforms normalise already
    scale=1.0,
    transformer_kwargs=_transformer,
    tokenizer_kwargs=dict(num_groups=128, context_length=128, group_max_points=32, group_radius=8 / _scale,
                          group_upscale_points=64, overlap_factor=0.72),
    criteria=[dict(type="CrossEntropyLoss", loss_weight=1.0, ignore_index=-1),
              dict(type="LovaszLoss", mode="multiclass", loss_weight=0.05, ignore_index=-1)],
)
_base_lr, _lr_decay = 2e-3, 0.75
param_dicts = [dict(keyword=f"encoder.blocks.{i}.", lr=_base_lr * _lr_decay ** (3 - i)) for i in range(4)]
optimizer = dict(type="AdamW", lr=_base_lr, weight_decay=0.05)
scheduler = dict(type="OneCycleLR", max_lr=[_base_lr] + [g["lr"] for g in param_dicts], pct_start=0.05,
                 anneal_strategy="cos", div_factor=10.0, final_div_factor=1000.0)

_prepare = [dict(type="LogTransform", min_val=0.01, max_val=20.0, keys=("energy",)),
            dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=_scale)]
_augment = [dict(type="RandomRotate", angle=[-1, 1], axis=axis, center=[0, 0, 0], p=0.8) for axis in "zxy"]
_augment += [dict(type="RandomFlip", p=0.5, axes=("x", "y", "z"))]
_pack = [dict(type="ToTensor"), dict(type="Collect", keys=("coord", "segment"), feat_keys=("coord", "energy"))]
data = dict(
    num_classes=5,
    ignore_index=-1,
    names=["shower", "track", "michel", "delta", "low_energy"],
    train=dict(type="LArTPCSynthDataset", num_events=30, split="train", transform=_prepare + _augment + _pack,
               in_memory=True),
    val=dict(type="LArTPCSynthDataset", num_events=100, split="val", transform=_prepare + _pack, in_memory=True),
)
default_hooks = dict(information_writer=dict(log_frequency=10))
hooks = [dict(type="SemSegEvaluator", write_cls_iou=True)]
