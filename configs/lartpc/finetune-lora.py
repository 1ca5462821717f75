# Parameter-efficient fine-tuning (upstream's LoRA recipe): the PT-v3 semantic
# segmentation model trained by configs/lartpc/semseg-ptv3.py, frozen, with
# rank-4 adapters on every attention projection (attn.qkv, attn.proj) and the
# head trained, on fresh events of the same generator.
#
#   python tools/train.py --config-file configs/lartpc/semseg-ptv3.py        # the base weight (27 min)
#   python tools/train.py --config-file configs/lartpc/finetune-lora.py \
#       --options weight=exp/lartpc/semseg-ptv3/model/model_best.pth
#
# The wrapped model lives under ``model.``, so the base weight's keys get that
# prefix (weight_key_map below); the adapters (lora_A, lora_B) are new and
# start as a no-op. LoRAAdapter.merged_state_dict() folds them back into the
# base weights: the result loads into semseg-ptv3.py's model as it is.
# The inner model must be the architecture the weight was trained with.
#
# Measured (2026-12-06, shared 2-core VM, torch 2.13 CPU): 2 min 22 s for the
# whole command (60 steps of 8, one evaluation); 9,381 of 912,085 parameters
# train (1.03 %: 28 adapter matrices on 14 projections, and the head).
_base_ = "_base_lartpc.py"

save_path = "exp/lartpc/finetune-lora"
epoch = 1
batch_size = 8
num_worker = 1

_transform = [
    dict(type="GridSample", grid_size=1.0, hash_type="fnv", mode="train", return_grid_coord=True),
    dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=768.0 * 3**0.5 / 2),
    dict(type="LogTransform", key="energy"),
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "grid_coord", "segment", "instance"), feat_keys=("coord", "energy")),
]
data = dict(train=dict(transform=_transform, num_events=480, in_memory=False, seed=1),  # events the base never saw
            val=dict(transform=_transform, num_events=48), test=dict(transform=_transform))

model = dict(
    type="LoRAAdapter",
    rank=4,
    alpha=8.0,
    dropout=0.0,
    target_modules=("attn.qkv", "attn.proj"),
    trainable_keywords=("seg_head",),
    model=dict(
        type="DefaultSegmentorV2",
        num_classes=5,
        backbone_out_channels=32,
        backbone=dict(
            type="PT-v3m2",
            in_channels=4,
            order=("z", "z-trans", "hilbert", "hilbert-trans"),
            stride=(2, 2, 2),
            enc_depths=(1, 1, 1, 1),
            enc_channels=(32, 48, 64, 96),
            enc_num_head=(2, 3, 4, 6),
            enc_patch_size=(64, 64, 64, 64),
            dec_depths=(1, 1, 1),
            dec_channels=(32, 48, 64),
            dec_num_head=(2, 3, 4),
            dec_patch_size=(64, 64, 64),
            mlp_ratio=2,
            drop_path=0.0,
            shuffle_orders=True,
            enable_rpe=False,
            enable_flash=True,
            upcast_attention=False,
            upcast_softmax=False,
        ),
        criteria=[dict(type="CrossEntropyLoss", ignore_index=-1), dict(type="LovaszLoss", ignore_index=-1)],
    ),
)
weight_key_map = [["backbone.", "model.backbone."], ["seg_head.", "model.seg_head."]]
optimizer = dict(type="AdamW", lr=1e-3, weight_decay=0.0)
scheduler = dict(_delete_=True, type="CosineAnnealingLR", eta_min=1e-5)  # replaces the base's warm-up cosine
default_hooks = dict(information_writer=dict(log_frequency=10))
hooks = [
    dict(type="SemSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"]),
]
