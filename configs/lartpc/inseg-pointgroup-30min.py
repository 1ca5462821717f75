# PointGroupLite trained to a 30-minute wall-time budget on a 2-core CPU
# (one thread): batch 4, lr 6e-3, 7,000 steps (4 epochs of 7,000 events).
# Results: see docs/models.md ("Speed and results").
_base_ = "inseg-pointgroup.py"

save_path = "exp/lartpc/inseg-pointgroup-30min"
epoch = 4
batch_size = 4
data = dict(train=dict(num_events=7000))
optimizer = dict(type="AdamW", lr=6e-3, weight_decay=1e-4)
hooks = [
    dict(type="CheckpointLoader"),
    dict(type="IterationTimer", warmup_iter=2),
    dict(type="InformationWriter", log_frequency=100),
    dict(type="InsSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"]),
    dict(type="SemSegEvaluator", num_classes=5, class_names=["shower", "track", "michel", "delta", "low_energy"]),
    dict(type="CheckpointSaver", save_freq=875, keep_all=True),
]
