# Runtime section of a config in upstream pimm's vocabulary: every key that
# upstream's configs/_base_/default_runtime.py defines, with upstream's
# default value (meanings: docs/migration.md).

weight = None  # checkpoint to start from
resume = False  # continue the run in save_path
evaluate = True  # run the evaluator hooks after each epoch
test_only = False

seed = None  # None: draw a seed and record it
save_path = "exp/default"
num_worker = 16  # data-loading workers, all processes together
batch_size = 16  # events per step, all processes together
batch_size_val = None  # None: one event per process
batch_size_test = None
epoch = 800
eval_epoch = 800
clip_grad = None

sync_bn = False
enable_amp = False
amp_dtype = "bfloat16"
empty_cache = False
empty_cache_per_epoch = False
find_unused_parameters = False
matmul_precision = None
prefetch_factor = None
detect_anomaly = False
mix_prob = 0
param_dicts = None
deterministic = False

hooks = [
    dict(type="CheckpointLoader"),
    dict(type="ModelHook"),
    dict(type="IterationTimer", warmup_iter=2),
    dict(type="InformationWriter"),
    dict(type="SemSegEvaluator"),
    dict(type="CheckpointSaver", save_freq=None),
    dict(type="FinalEvaluator", test_last=False),
]

train = dict(type="DefaultTrainer")
test = dict(type="SemSegTester", verbose=True)
