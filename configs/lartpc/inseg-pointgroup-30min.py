# PointGroupLite trained to a 30-minute wall-time budget on a 2-core CPU
# (one thread): batch 4, lr 6e-3, 7,000 steps (4 epochs of 7,000 events).
# Results: see docs/models.md ("Speed and results").
_base_ = "inseg-pointgroup.py"

save_path = "exp/lartpc/inseg-pointgroup-30min"
epoch = 4
batch_size = 4
data = dict(train=dict(num_events=7000))
optimizer = dict(type="AdamW", lr=6e-3, weight_decay=1e-4)
# Clustering (evaluation only; radii per class: shower, track, Michel, delta,
# low-energy). Showers: votes within 12 voxels connect, pieces within 35
# merge; tracks 6 / 10; delta rays follow adjacency alone (agree 1000) and
# merge only with identical votes (0.5); then clusters of <= 2 points join
# the cluster they touch most (misclassified specks), and clusters smaller
# than 16 / 12 / 3 / 2 points (shower / track / Michel / delta) are dropped.
model = dict(agree_radius=(12.0, 6.0, 4.0, 1000.0, 3.0), merge_radius=(35.0, 10.0, 10.0, 0.5, 10.0),
             min_points=(16, 12, 3, 2, 1), absorb_points=2)
hooks = [
    dict(type="CheckpointLoader"),
    dict(type="IterationTimer", warmup_iter=2),
    dict(type="InformationWriter", log_frequency=100),
    dict(type="InsSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"]),
    dict(type="SemSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"]),
    dict(type="CheckpointSaver", save_freq=875),
]
