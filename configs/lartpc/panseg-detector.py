# Panoptic particle detection on synthetic LArTPC events with upstream's
# Panda detector (detector-v5), small enough to train on a 2-core CPU:
#
#   OMP_NUM_THREADS=1 python tools/train.py --config-file configs/lartpc/panseg-detector.py
#
# Two label sets as upstream's joint configs (configs/panda/panseg/
# detector-v5-pt-v3m2-ft-joint-pxpypz-*.py): "particle" (photon, electron,
# muon, pion, proton; low-energy "led" is stuff) with momentum, momentum
# direction, vertex and is_primary heads, and "interaction" (stuff / thing)
# with a vertex head. The generator gives every truth key the detector needs
# (pimm/datasets/lartpc.py); it simulates no pions, so that class never occurs.
# InstanceSegmentationEvaluator reports upstream's metrics per label
# (val/particle/ins_det_f1, ins_pq, ins_cls_macro_f1, momentum_mae,
# vertex_dist, ..., docs/models.md "Panoptic detector").
#
# Widths are small (encoder 16-64, decoder 64 wide, 2 blocks); upstream's are
# 48-512 and 256. Results of a run are in README.md.
_base_ = "_base_lartpc.py"

save_path = "exp/lartpc/panseg-detector"
epoch = 1
batch_size = 8
batch_size_val = 8
num_worker = 1

particle_names = ["photon", "electron", "muon", "pion", "proton", "led"]
interaction_names = ["stuff", "thing"]
_targets = ("segment_pid", "instance_particle", "segment_interaction", "instance_interaction", "momentum",
            "momentum_vec", "vertex", "is_primary")
_transform = [
    # momentum_vec is a direction: rotations turn it, translations and scales leave it.
    dict(type="Update", keys_dict={"aux_direction_keys": ["momentum_vec"]}),
    dict(type="GridSample", grid_size=1.0, hash_type="fnv", mode="train", return_grid_coord=True),
    dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=768.0 * 3**0.5 / 2),
    dict(type="LogTransform", min_val=1.0e-2, max_val=20.0, keys=("energy",)),
    dict(type="MomentumTransform", keys=("momentum",)),  # log10 |p|, as upstream
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "grid_coord", *_targets), feat_keys=("coord", "energy")),
]
_events = dict(type="LArTPCSynthDataset", points_per_event=(800, 1500), transform=_transform)
data = dict(
    names=particle_names,
    interaction_names=interaction_names,
    train=dict(_events, num_events=12000, split="train", in_memory=False),
    val=dict(_events, num_events=48, split="val", in_memory=True),
    test=dict(_events, num_events=96, split="test", in_memory=False),
)


def _criterion():
    return dict(type="FastUnifiedInstanceLoss", cost_mask=1.0, cost_dice=1.0, cost_class=1.0, loss_weight_focal=2.0,
                loss_weight_dice=5.0, cls_weight_matched=2.0, cls_weight_noobj=0.5, focal_alpha=0.25, focal_gamma=2.0,
                aux_loss_weight=1.0, num_points=100_000)


_W = (16, 32, 48, 64)
model = dict(
    type="detector-v5",
    eval_label="particle",
    label_configs=dict(
        particle=dict(
            num_queries=32, num_classes=6, instance_key="instance_particle", segment_key="segment_pid",
            stuff_classes=[5], use_stuff_head=True, loss_weight=1.0, overlap=False,
            query_heads=[
                dict(name="momentum", use_class_logits=True, sentinel=-1.0),  # log10 |p|; led has none (-1)
                dict(name="momentum_vec", dim=3, use_class_logits=True, sentinel=-1.0, unit_normalize=True),
                dict(name="vertex", dim=3, sentinel=-1.0),
                dict(name="is_primary", kind="categorical", num_classes=2),
            ],
            criterion=_criterion(),
        ),
        interaction=dict(
            num_queries=8, num_classes=2, instance_key="instance_interaction", segment_key="segment_interaction",
            stuff_classes=[0], use_stuff_head=True, loss_weight=1.0, overlap=False,
            query_heads=[dict(name="vertex", dim=3, sentinel=-1.0)],
            criterion=_criterion(),
        ),
    ),
    supervise_attn_mask=True,
    backbone=dict(
        type="PT-v3m2",
        in_channels=4,  # xyz + log energy
        order=("z", "z-trans", "hilbert", "hilbert-trans"),
        stride=(2, 2, 2),
        enc_depths=(1, 1, 1, 1),
        enc_channels=_W,
        enc_num_head=(1, 2, 3, 4),
        enc_patch_size=(64, 64, 64, 64),
        mlp_ratio=2,
        drop_path=0.0,
        shuffle_orders=True,
        enable_rpe=False,
        enable_flash=True,
        enc_mode=True,  # encoder only: every level's features concatenated back onto the points
    ),
    full_in_channels=sum(_W),
    mlp_point_proj=True,
    hidden_channels=64,
    num_heads=4,
    depth=2,
    mlp_ratio=2.0,
    qkv_bias=True,
    pre_norm=True,
    pos_emb=True,
    postprocess=dict(stuff_threshold=0.5, mask_threshold=0.5, conf_threshold=0.5, nms_kernel="gaussian",
                     nms_sigma=2.0, nms_pre=-1, nms_max=-1, min_points=2, fill_uncovered=False),
)
optimizer = dict(type="AdamW", lr=2e-3, weight_decay=0.01)
scheduler = dict(type="CosineWarmupLR", warmup_steps=30)
clip_grad = 1.0
default_hooks = dict(information_writer=dict(log_frequency=20), checkpoint=dict(save_freq=100, save_every_minutes=3))
hooks = [
    dict(type="InstanceSegmentationEvaluator", every_n_steps=250, stuff_threshold=0.5, mask_threshold=0.5,
         iou_thresh=0.5, class_names={"particle": particle_names[:-1], "interaction": interaction_names},
         require_class_for_match=False, labels=("particle", "interaction"), primary_label="particle"),
    dict(type="AttentionMaskAnnealingHook", log_frequency=100),
]
# tools/test.py (and FinalEvaluator): the same metrics on data.test.
test = dict(type="InstanceSegTester", class_names={"particle": particle_names[:-1], "interaction": interaction_names},
            labels=("particle", "interaction"), primary_label="particle")
