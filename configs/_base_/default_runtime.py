# Runtime defaults shared by every pimm config. The engine falls back to the
# same values (pimm/engines/runtime.py) for a config that omits a key.

save_path = "exp/default"
seed = 0  # recorded in config.py; every RNG stream derives from it
epoch = 1  # absolute horizon: raising it and resuming extends a finished run
batch_size = 16  # global, split evenly across processes
batch_size_val = None  # global; None = batch_size
num_worker = 0  # global data-loading workers, split across processes
resume = False  # continue from the newest complete checkpoint in save_path
weight = None  # warm-start weights (a .pth file)
evaluate = True  # run the evaluator hooks
enable_amp = False
amp_dtype = "bfloat16"  # "float16" needs CUDA (uses a GradScaler)
clip_grad = None  # max gradient norm
grad_accum_steps = 1
use_wandb = False  # W&B run (WANDB_MODE=offline works without network)
wandb_project = "pimm"
enable_tensorboard = True
preempt_signals = ["SIGTERM"]  # e.g. ["SIGTERM", "SIGUSR2"] for SLURM --signal
param_dicts = None  # per-parameter-group options, see docs/engine.md

train = dict(type="DefaultTrainer")

hooks = [
    dict(type="CheckpointLoader"),
    dict(type="IterationTimer", warmup_iter=2),
    dict(type="InformationWriter", log_frequency=20),
    dict(type="ProgressBar"),
    dict(type="CheckpointSaver", save_freq=None, keep_last=2),
]
