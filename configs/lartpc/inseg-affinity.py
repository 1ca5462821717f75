# Instance segmentation (particles) of synthetic LArTPC events: SparseUNet +
# semantic, centroid-offset and embedding heads; fragments of agreeing votes
# merged by average linkage on the learned pairwise affinity
# (PointGroupAffinity, docs/models.md). Baseline: inseg-pointgroup.py.
_base_ = "_base_lartpc.py"

save_path = "exp/lartpc/inseg-affinity"
epoch = 8
train = dict(type="InsegTrainer")
model = dict(type="PointGroupAffinity", num_classes=5, stuff_classes=(4,),
             backbone=dict(type="SparseUNet", in_channels=1, grid_size=1.0, channels=(16, 32, 48, 64, 96, 128),
                           enc_blocks=(1, 1, 1, 1, 1, 1), dec_blocks=(1, 1, 1, 1, 1)),
             criteria=[dict(type="CrossEntropyLoss", ignore_index=-1), dict(type="LovaszLoss", ignore_index=-1)],
             # offsets regressed in units of 50 voxels; affinity = exp(-|dvote|^2 / sigma^2 - |dg|^2)
             # with a learned per-class sigma (initial 20 voxels) and 4 free embedding dimensions
             offset_scale=50.0, offset_weight=1.0, direction_weight=1.0,
             embed_dim=4, vote_bandwidth=20.0, affinity_weight=1.0, pairs_per_point=4,
             # clustering per predicted class (shower, track, Michel, delta, low-energy)
             agree_radius=(6.0, 3.0, 4.0, 4.0, 3.0), fragment_affinity=0.5, merge_affinity=0.5)
hooks = [
    dict(type="CheckpointLoader"),
    dict(type="IterationTimer", warmup_iter=2),
    dict(type="InformationWriter", log_frequency=50),
    dict(type="ProgressBar"),
    dict(type="InsSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"]),
    dict(type="SemSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"]),
    dict(type="CheckpointSaver", save_freq=500),
]
