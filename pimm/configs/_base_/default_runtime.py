# Runtime defaults shared by every pimm config. GENERATED from pimm/engines/run/runtime.py by
# tools/write_default_runtime.py; a config without _base_ gets the same values from the
# engine. Edit the table there, not this file. Any config names it as
# _base_ = "pimm://_base_/default_runtime.py" (docs/config.md).

save_path = 'exp/default'  # the run directory (~ is expanded)
seed = 0  # every RNG stream derives from it; None draws one and records it in config.py
epoch = 1  # absolute horizon: raising it and resuming extends a finished run
batch_size = 16  # global, split evenly across processes
batch_size_val = None  # global; None = batch_size
num_worker = 0  # global data-loading workers, split across processes
resume = False  # continue from the newest complete checkpoint; 'allow_fresh' also starts fresh when none is usable; a checkpoint folder's path: continue from that one
trust_checkpoint_code = False  # resume/fork: also load a checkpoint that holds more than data (one written before pimm saved plain states); unpickling it runs whatever code it names: only for checkpoints you trust
validate_on_resume = False  # a resumed run evaluates its weights (val/* at the resumed step) before training continues
scheduler_interval = 1  # optimizer updates per scheduler step (the schedule's length is counted in scheduler steps)
weight = None  # warm-start weights: a .pth/.safetensors file, a run, checkpoint or export folder, or hf://org/name
weight_key_map = None  # warm start: [old_prefix, new_prefix] pairs renaming the weight file's keys
evaluate = True  # run the evaluator hooks
enable_amp = False  # mixed precision (autocast)
amp_dtype = 'bfloat16'  # 'float16' needs CUDA (uses a GradScaler)
clip_grad = None  # max gradient norm (None: no clipping); several optimizers: one for all or dict(<part>=...)
grad_accum_steps = 1  # micro-batches per optimizer step
log_grad_norm = False  # log train/grad_norm every step (always logged when clipping)
gradient_checkpointing = None  # recompute these submodules' activations in backward (fnmatch patterns, e.g. ['backbone.enc*'])
use_wandb = False  # W&B run (WANDB_MODE=offline works without network)
wandb_project = 'pimm'  # W&B project
wandb_entity = None  # W&B team or user (None: your default entity)
wandb_run_name = None  # W&B run name (None: the save_path folder's name)
wandb_group = None  # W&B run group
wandb_job_type = None  # W&B job type
wandb_tags = None  # W&B run tags, e.g. ['baseline']
wandb_run_id = None  # W&B run id (None: drawn at the start and kept in checkpoints, so a resume continues the same run)
wandb_resume = None  # W&B resume mode: 'allow' (None), 'must', 'never' or 'auto'
launch_command = None  # the command that launched the job, shown as the W&B run's notes
log_step_offset = 0  # added to every step sent to W&B (metrics.jsonl and TensorBoard keep the run's own steps)
enable_tensorboard = True  # TensorBoard event files under save_path/tensorboard
preempt_signals = ['SIGTERM']  # signals that checkpoint and exit 75, e.g. ['SIGTERM', 'SIGUSR2'] for SLURM --signal
param_dicts = None  # per-parameter-group options, see docs/engine.md; several optimizers: dict(<part>=[...])
scheduler = None  # a dict(type=...) from SCHEDULERS; None: constant lr; several optimizers: dict(<part>=dict(type=...))
batch_size_test = None  # global; None = batch_size_val, else batch_size
eval_epoch = None  # evaluations in the run: every max(1, epoch // eval_epoch) epochs, the last always (None: every epoch)
test_only = False  # tools/train.py scores `weight` on data.test instead of training
test = None  # a dict(type=...) from TESTERS for tools/test.py (None: the evaluator hooks on data.test)
iters_per_epoch = None  # steps (GRPO: rollouts) per epoch over an iterable training set; None: num_samples() // processes // batch per process
mix_prob = 0.0  # probability that the train collate mixes pairs of events
matmul_precision = None  # torch.set_float32_matmul_precision (None: leave torch's)
deterministic = False  # deterministic algorithms (and no TF32, cuDNN benchmarking off)
detect_anomaly = False  # run training under torch.autograd.detect_anomaly (slow)
empty_cache = False  # torch.cuda.empty_cache() after every step (CUDA)
empty_cache_per_epoch = False  # torch.cuda.empty_cache() after every epoch (CUDA)
sync_bn = False  # BatchNorm -> SyncBatchNorm when distributed on CUDA
find_unused_parameters = False  # passed to DDP (also a train option)
parallel = {'strategy': 'ddp', 'shard_modules': None, 'reshard_after_forward': True, 'mixed_precision': None}  # strategy 'ddp' (replicas) or 'fsdp' (FSDP2 sharding; options in docs/distributed.md)
compile = {'enabled': False, 'mode': None, 'dynamic': None, 'fullgraph': False, 'backend': 'inductor'}  # torch.compile the training model (enabled=True; mode/dynamic/fullgraph/backend as torch.compile's)
prefetch_factor = None  # batches each data worker loads ahead (None: torch's default, 2)
structured_logging = {'enabled': False, 'trace_hooks': False, 'batch_stats_every': 1, 'max_bytes': 33554432, 'max_files': 20, 'flush_every_s': 1.0}  # per-rank step traces under save_path/trace/ (`pimm trace summarize RUN`)
checkpoint_format = None  # accepted for upstream configs: pimm always writes its verified checkpoints/ layout

train = dict(type='DefaultTrainer')

# The runtime services every run gets, by name: switch one off with None or change its
# options here, in a config (default_hooks = dict(live_control=None)) or with --options
# default_hooks.checkpoint.keep_last=5. `hooks` adds to them (docs/hooks.md).
default_hooks = dict(
    checkpoint_loader=dict(type='CheckpointLoader'),
    timer=dict(type='IterationTimer', warmup_iter=2),
    information_writer=dict(type='InformationWriter', log_frequency=20),
    progress_bar=dict(type='ProgressBar'),
    live_control=dict(type='LiveControl'),
    on_demand_validation=dict(type='OnDemandValidation'),
    checkpoint=dict(type='CheckpointSaver', save_freq=None, keep_last=2),
)

hooks = []
