# A generator of Cherenkov ring images against a discriminator: the example of
# several networks trained by several optimizers (GANTrainer, docs/trainers/gan.md).
# Trains in a few minutes on a 2-core CPU; RingGANEvaluator compares the generated
# rings' hit count, total charge and radius with the real ones (figures in the docs).
_base_ = "../_base_/default_runtime.py"

save_path = "exp/rings/gan"
seed = 0
epoch = 8
batch_size = 32
batch_size_val = 250
num_worker = 0

train = dict(type="GANTrainer")  # updates the parts in the optimizer's order: disc, then gen
# max_value: the generator's soft ceiling on log1p(charge); 4.5 (~90 PE in a pixel) keeps a few
# over-bright pixels from dominating the total charge (0.4 % of real hit pixels are brighter).
model = dict(type="RingGAN", image_size=(16, 32), channels=1, latent_dim=32, width=16, depth=3, max_value=4.5)
# One optimizer per submodule of the model, named after it (model.disc, model.gen).
optimizer = dict(
    disc=dict(type="Adam", lr=2e-4, betas=(0.5, 0.999)),
    gen=dict(type="Adam", lr=2e-4, betas=(0.5, 0.999)),
)
scheduler = dict(
    disc=dict(type="ConstantLR"),
    gen=dict(type="CosineWarmupLR", warmup_ratio=0.05, min_lr_ratio=0.1),
)
log_grad_norm = True  # train/grad_norm/disc and train/grad_norm/gen

data = dict(
    train=dict(type="CherenkovRingDataset", num_events=2000, split="train", image_size=(16, 32), with_time=False,
                 in_memory=True),
    val=dict(type="CherenkovRingDataset", num_events=500, split="val", image_size=(16, 32), with_time=False,
               in_memory=True),
)

default_hooks = dict(information_writer=dict(log_frequency=10))  # the runtime services (docs/hooks.md)
hooks = [
    dict(type="RingGANEvaluator"),
]
