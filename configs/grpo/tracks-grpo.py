# GRPO task 1: propose the tracks of an event (direction and muon/proton type)
# one after another; reward = F1 of the proposals matched to the true tracks.
# Learns on a 2-core CPU in about a minute (figures and command in the README).
_base_ = "../_base_/default_runtime.py"

save_path = "exp/grpo/tracks"
seed = 0
epoch = 1
batch_size = 16  # events per rollout (global); each gets num_generations trajectories
batch_size_val = 256
num_worker = 0

_tolerance = 10.0  # degrees: a proposal matches a track this close in direction (and of its class)

train = dict(
    type="GRPOTrainer",
    policy_updates_per_rollout=2,
    trajectory_microbatch_size=64,  # 8 events x 8 trajectories per micro-batch: 2 per update
    torch_threads=1,  # a policy this small runs fastest on one thread
)
model = dict(
    type="TrackProposalPolicy",
    num_direction_bins=24,
    num_classes=2,
    max_proposals=4,
    num_generations=8,
    angle_tolerance_deg=_tolerance,
    hidden=32,
    stop_bias=2.5,
    grpo=dict(epsilon=0.2, epsilon_high=0.28, beta=0.04, scale_rewards="group", loss_type="dapo"),
)
optimizer = dict(type="Adam", lr=1e-3)
scheduler = dict(type="CosineWarmupLR")  # decays to 0 over the 600 steps

data = dict(
    train=dict(type="StraightTracksDataset", num_events=4800, split="train"),  # 300 rollouts x 2 updates = 600 steps
    val=dict(type="StraightTracksDataset", num_events=512, split="val"),
    test=dict(type="StraightTracksDataset", num_events=512, split="test"),
)

# The runtime services come from the base's default_hooks (docs/hooks.md).
default_hooks = dict(information_writer=dict(log_frequency=50), checkpoint=dict(save_freq=200))
hooks = [
    dict(type="ProposalEvaluator", angle_tolerance_deg=_tolerance, every_n_steps=100),
]
