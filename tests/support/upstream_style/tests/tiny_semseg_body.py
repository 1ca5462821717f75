# A tiny PILArNet semantic-segmentation run in upstream pimm's vocabulary:
# its transform list, data section (class count and names next to the
# splits), evaluator without arguments. The model is pimm's SparseUNet.

model = dict(
    type="DefaultSegmentor",
    num_classes=5,
    backbone=dict(type="SparseUNet", in_channels=4, channels=(8, 16), enc_blocks=(1, 1), dec_blocks=(1,)),
    criteria=[dict(type="CrossEntropyLoss", loss_weight=1.0, ignore_index=-1)],
)

optimizer = dict(type="AdamW", lr=1.0e-3, weight_decay=0.01)
scheduler = dict(type="OneCycleLR", max_lr=1.0e-3, pct_start=0.1, anneal_strategy="cos",
                 div_factor=10.0, final_div_factor=100.0)

# Detector cube of side 768 mapped into the unit ball; log-compressed energy.
transform = [
    dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=768.0 * 3**0.5 / 2),
    dict(type="LogTransform", min_val=0.01, max_val=20.0),
    dict(type="GridSample", grid_size=0.001, hash_type="fnv", mode="train", return_grid_coord=True),
    dict(type="Copy", keys_dict={"segment_motif": "segment"}),
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "grid_coord", "segment"), feat_keys=("coord", "energy")),
]

data = dict(
    num_classes=5,
    ignore_index=-1,
    names=["shower", "track", "michel", "delta", "led"],
    train=dict(type="PILArNetH5Dataset", data_root=None, revision="v2", split="train",
               transform=transform, min_points=0, max_len=8),
    val=dict(type="PILArNetH5Dataset", data_root=None, revision="v2", split="val",
             transform=transform, min_points=0, max_len=4),
)

hooks = [
    dict(type="CheckpointLoader"),
    dict(type="IterationTimer", warmup_iter=0),
    dict(type="InformationWriter"),
    dict(type="SemSegEvaluator"),
    dict(type="CheckpointSaver", save_freq=None),
]

train = dict(type="DefaultTrainer")
