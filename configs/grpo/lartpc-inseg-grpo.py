# GRPO task 2: fine-tune the clustering of a supervised LArTPC instance model
# (configs/lartpc/inseg-pointgroup.py) event by event. The network is frozen;
# a small policy head picks, per event, a scale for each class's clustering
# radii; reward = the event's ARI. Start from the supervised weights:
#   python tools/train.py --config-file configs/grpo/lartpc-inseg-grpo.py \
#       --options weight=exp/lartpc/inseg-pointgroup/model/model_last.pth
# ClusterPolicyEvaluator scores the greedy policy and the supervised radii on
# the same events (val/ARI vs val/ARI_supervised); tools/test.py does the same
# on the test split. Figures and commands: docs/grpo.md, "Task 2".
_base_ = "../lartpc/inseg-pointgroup.py"  # the supervised model, data and transforms

save_path = "exp/grpo/lartpc-inseg"
epoch = 1
batch_size = 8  # events per rollout; each gets num_generations trajectories

train = dict(
    type="GRPOTrainer",
    collate_fn="inseg_collate_fn",  # instance ids unique across the events of a batch
    val_collate_fn="inseg_collate_fn",
    policy_updates_per_rollout=2,
    trajectory_microbatch_size=None,
)
model = dict(
    type="ClusterRadiusPolicy",  # PointGroupLite's options come from the base config
    radius_scales=(0.5, 0.7, 0.85, 1.0, 1.2, 1.4, 2.0),
    radius_kinds=("agree", "merge"),
    num_generations=8,
    hidden=64,
    keep_bias=1.0,
    use_event_features=True,  # False: one global recalibration of the radii (the baseline)
    grpo=dict(epsilon=0.2, epsilon_high=0.28, beta=0.02, scale_rewards="group", loss_type="dapo"),
)
optimizer = dict(_delete_=True, type="Adam", lr=2e-3)
scheduler = dict(_delete_=True, type="CosineWarmupLR", warmup_ratio=0.05)  # 20 of the 400 steps

data = dict(train=dict(num_events=1600))  # 200 rollouts x 2 updates = 400 steps

_classes = ["shower", "track", "michel", "delta", "low_energy"]
default_hooks = dict(information_writer=dict(log_frequency=20), checkpoint=dict(save_freq=100))
hooks = [
    dict(type="ClusterPolicyEvaluator", class_names=_classes, every_n_steps=100),
]
