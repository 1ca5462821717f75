# Upstream's tiny test run: the runtime keys of its tests/tiny_semseg.py on
# top of its default runtime, with the body in tiny_semseg_body.py.
_base_ = ["../_base_/default_runtime.py", "tiny_semseg_body.py"]

seed = 0
deterministic = False
use_wandb = False
evaluate = True
epoch = 1
eval_epoch = 1
batch_size = 4
batch_size_val = 1
batch_size_test = 1
num_worker = 0
mix_prob = 0.0
enable_amp = False
matmul_precision = "high"
checkpoint_format = "standard"

test = dict(type="SemSegTester", verbose=False)
