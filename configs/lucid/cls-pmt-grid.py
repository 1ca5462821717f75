# Particle type (electron vs muon) from the PMT response of LUCiD-format
# water-Cherenkov shards, read by upstream's LUCiDEventSSLDataset (one "config"
# folder per species, labelled by species; a fixed holdout of each for
# validation). Make the shards first (about 10 s):
#     python tools/make_lucid.py --out data/lucid --num-events 2000
# Figures and command in the README.
_base_ = "../_base_/default_runtime.py"

save_path = "exp/lucid/cls-pmt-grid"
seed = 0
epoch = 4
batch_size = 64
batch_size_val = 256
num_worker = 0

model = dict(type="PMTGridClassifier", grid=(32, 64), num_classes=2, target_key="event_label", width=16, depth=3)
optimizer = dict(type="AdamW", lr=3e-3, weight_decay=0.01)
scheduler = dict(type="OneCycleLR", pct_start=0.15)

_lucid = dict(type="LUCiDEventSSLDataset", data_root="data/lucid", configs=["electron", "muon"],
              holdout_events_per_config=500, holdout_strategy="tail")
data = dict(
    num_classes=2,
    names=["electron", "muon"],
    train=dict(_lucid, split="train"),
    val=dict(_lucid, split="val"),
    test=dict(_lucid, split="test"),
)

default_hooks = dict(information_writer=dict(log_frequency=10))
hooks = [
    dict(type="ClsEvaluator", num_classes=2, class_names=["electron", "muon"], target_key="event_label"),
]
