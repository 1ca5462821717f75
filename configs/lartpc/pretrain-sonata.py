# Sonata self-supervised pre-training (stage 1 of docs/pretraining.md) of a
# small PT-v3m2 encoder on generated LArTPC events, no labels used; upstream's
# pilarnet-smallmask recipe (views, masks, schedules, hooks), small enough for
# the 2-core CPU: 960 optimizer steps of 2 events, 12 min 25 s for the
# command on the quiet VM with OMP_NUM_THREADS=1 (2026-12-07 09:09 UTC, 741 s
# of training; online probe 0.379 -> 0.424). The frozen encoder's features
# keep improving past 480 steps (docs/pretraining.md has the measured runs).
# Batches of 2 give twice the updates of batches of 4 for the same compute,
# which this short run needs more than larger batches (the learning rate is
# scaled by sqrt(2/4) from the batch-4 value, as upstream scales its base_lr).
#
#   python tools/train.py --config-file configs/lartpc/pretrain-sonata.py
#
# Then fine-tune with 1% of the labels: configs/lartpc/finetune-sonata-lin.py
# (frozen encoder + linear head) or finetune-sonata-fft.py (everything).
_base_ = "../_base_/default_runtime.py"

save_path = "exp/lartpc/pretrain-sonata"
seed = 0
epoch = 1
batch_size = 2  # 1,920 events -> 960 steps
num_worker = 1
clip_grad = 3.0

_grid_size = 0.001  # in the normalised coordinates: finer than a voxel, so every voxel is a point
_warmup_ratio = 0.05

encoder = dict(
    type="PT-v3m2",
    in_channels=4,  # x, y, z, log energy
    order=("z", "z-trans", "hilbert", "hilbert-trans"),
    stride=(2, 2, 2),
    enc_depths=(1, 1, 1, 1),
    enc_channels=(32, 48, 64, 96),
    enc_num_head=(2, 3, 4, 6),
    enc_patch_size=(64, 64, 64, 64),
    mlp_ratio=2,
    layer_scale=1e-5,
    drop_path=0.1,
    shuffle_orders=True,
    enable_rpe=False,
    enable_flash=True,
    traceable=True,
    enc_mode=True,
    mask_token=True,
)
model = dict(
    type="Sonata-v1m1",
    backbone=encoder,
    teacher_custom=dict(drop_path=0.0),
    head_in_channels=48 + 64 + 96,  # up_cast_level=2: the last three levels
    head_hidden_channels=256,
    head_embed_channels=64,
    head_num_prototypes=256,
    num_global_view=2,
    num_local_view=4,
    mask_size_start=0.01,
    mask_size_base=0.05,
    mask_size_warmup_ratio=_warmup_ratio,
    mask_ratio_start=0.5,
    mask_ratio_base=0.8,
    mask_ratio_warmup_ratio=_warmup_ratio,
    mask_jitter=_grid_size / 2,
    teacher_temp_start=0.04,
    teacher_temp_base=0.07,
    teacher_temp_warmup_ratio=_warmup_ratio,
    student_temp=0.1,
    mask_loss_weight=2 / 8,
    roll_mask_loss_weight=2 / 8,
    unmask_loss_weight=4 / 8,
    momentum_base=0.994,
    momentum_final=1.0,
    match_max_r=3 * _grid_size,  # a voxel is 0.0015 here: neighbouring voxels match
    up_cast_level=2,
)

_base_lr, _lr_decay = 1.5e-3, 0.9
_depths = encoder["enc_depths"]
param_dicts = [dict(keyword=f"enc{e}.block{b}.", lr=_base_lr * _lr_decay ** (sum(_depths) - sum(_depths[:e]) - b - 1))
               for e in range(len(_depths)) for b in range(_depths[e])]
optimizer = dict(type="AdamW", lr=_base_lr, weight_decay=0.04)
scheduler = dict(type="OneCycleLR", max_lr=[_base_lr] + [g["lr"] for g in param_dicts], pct_start=_warmup_ratio,
                 anneal_strategy="cos", div_factor=10.0, final_div_factor=1000.0)

_normalise = dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=768.0 * 3**0.5 / 2)
_view = [
    dict(type="CenterShift", axes=("x", "y", "z")),
    dict(type="RandomRotate", angle=[-1, 1], axis="z", center=[0, 0, 0], p=0.8),
    dict(type="RandomRotate", angle=[-1, 1], axis="x", center=[0, 0, 0], p=0.8),
    dict(type="RandomRotate", angle=[-1, 1], axis="y", center=[0, 0, 0], p=0.8),
    dict(type="RandomFlip", p=0.5, axes=("x", "y", "z")),
    dict(type="RandomJitter", sigma=_grid_size / 4, clip=_grid_size, keys=("coord",)),
]
_pretrain = [
    _normalise,
    dict(type="RandomScale", scale=[0.9, 1.1]),
    dict(type="GridSample", grid_size=_grid_size, hash_type="fnv", mode="train", sum_keys=("energy",)),
    dict(type="LogTransform", min_val=0.01, max_val=20.0, keys=("energy",)),
    dict(type="Copy", keys_dict={"coord": "origin_coord"}),
    dict(type="MultiViewGenerator", view_keys=("coord", "origin_coord", "energy"), global_view_num=2,
         global_view_scale=(0.4, 1.0), local_view_num=4, local_view_scale=(0.1, 0.4),
         global_shared_transform=[dict(type="MultiplicativeRandomJitter", sigma=0.05, clip=0.05, keys=("energy",),
                                       p=0.8)],
         global_transform=_view, local_transform=_view, max_size=30000),
    dict(type="ToTensor"),
    dict(type="Update", keys_dict={"grid_size": _grid_size}),
    dict(type="Collect", keys=("global_origin_coord", "global_coord", "global_energy", "global_offset",
                               "local_origin_coord", "local_coord", "local_energy", "local_offset", "grid_size"),
         global_feat_keys=("global_coord", "global_energy"), local_feat_keys=("local_coord", "local_energy")),
]
# The labelled validation events only feed the online linear probe.
_probe = [
    _normalise,
    dict(type="GridSample", grid_size=_grid_size, hash_type="fnv", mode="train", return_grid_coord=True),
    dict(type="LogTransform", min_val=0.01, max_val=20.0, keys=("energy",)),
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "grid_coord", "segment"), feat_keys=("coord", "energy")),
]
data = dict(
    num_classes=5,
    names=["shower", "track", "michel", "delta", "low_energy"],
    train=dict(type="LArTPCSynthDataset", num_events=1920, split="train", transform=_pretrain),
    val=dict(type="LArTPCSynthDataset", num_events=60, split="val", transform=_probe, in_memory=True),
)

# The runtime services (checkpoint loading and saving, timer, log lines, live
# control) come from the base's default_hooks; upstream's CheckpointSaverIteration
# is default_hooks.checkpoint's save_freq here.
default_hooks = dict(information_writer=dict(log_frequency=25), checkpoint=dict(save_freq=160))
hooks = [
    dict(type="ParameterCounter", show_details=False, show_gradients=False, min_params=1),
    dict(type="WeightDecayExclusion"),
    dict(type="ModelHook"),
    dict(type="WeightDecayScheduler", base_value=0.04, final_value=0.2, warmup_ratio=1.0),
    dict(type="GradientNormLogger", log_frequency=25),
    dict(type="PretrainEvaluator", every_n_steps=160, max_train_events=30, max_test_events=30, write_cls_iou=True),
    dict(type="PrototypeUsageLogger", log_frequency=25),
    dict(type="FeatureStdMonitor", log_frequency=25),
    dict(type="ResourceUtilizationLogger", log_frequency=100),
]
