# The same run on pimm's own runtime defaults: only runtime keys pimm's
# engine knows, so this variant isolates the data, transform and evaluator
# vocabulary.
_base_ = ["../../../../configs/_base_/default_runtime.py", "tiny_semseg_body.py"]

seed = 0
use_wandb = False
evaluate = True
epoch = 1
batch_size = 4
batch_size_val = 1
num_worker = 0
enable_amp = False
