# PoLAr-MAE self-supervised pre-training (masked point modelling: the hidden
# groups' points and energies are predicted from the visible ones) of a small
# ViT on generated LArTPC events, no labels used; upstream's
# configs/polarmae/pretrain-polarmae-pilarnet.py recipe at a size this 2-core
# CPU runs in about 15 minutes. docs/pretraining.md compares it with Sonata.
#
#   python tools/train.py --config-file configs/lartpc/pretrain-polarmae.py
#
# Then fine-tune on 1% of the labels: configs/lartpc/finetune-polarmae.py.
_base_ = "../_base_/default_runtime.py"

save_path = "exp/lartpc/pretrain-polarmae"
seed = 0
epoch = 1
batch_size = 8
num_worker = 1
clip_grad = 3.0
_warmup_ratio = 0.05

_scale = 768 * 3**0.5 / 2  # the detector's half-diagonal, in voxels: coordinates land in [-1, 1]
# Tokens: groups of up to 32 points within 8 voxels of a centre; fewer seeds and
# a shorter context than upstream's preset (2048 / 512) for the CPU.
_tokenizer = dict(num_groups=128, context_length=128, group_max_points=32, group_radius=8 / _scale,
                 group_upscale_points=64, overlap_factor=0.72)
_transformer = dict(embed_dim=96, depth=4, num_heads=4, mlp_ratio=2.0, postnorm=True, add_pos_at_every_layer=True,
                    drop_rate=0.0, attn_drop_rate=0.05, drop_path_rate=0.1)
model = dict(
    type="PoLAr-MAE",
    arch="vit_tiny",
    num_channels=4,  # x, y, z, log energy
    voxel_size=5,
    masking_ratio=0.6,
    masking_type="rand",
    transformer_kwargs=_transformer,
    tokenizer_kwargs=_tokenizer,
    decoder_arch="vit_tiny",
    decoder_kwargs=dict(transformer_kwargs=dict(_transformer, depth=2)),
    mae_prediction="full",
    loss_weights=dict(chamfer=1.0, energy=1.0),
)

optimizer = dict(type="AdamW", lr=1e-3, weight_decay=0.05)
scheduler = dict(type="OneCycleLR", max_lr=1e-3, pct_start=_warmup_ratio, anneal_strategy="cos", div_factor=11.6,
                 final_div_factor=11.6)

_log = dict(type="LogTransform", min_val=0.01, max_val=20.0, keys=("energy",))
_norm = dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=_scale)
data = dict(
    train=dict(type="LArTPCSynthDataset", num_events=1600, split="train", transform=[
        _log, _norm,
        dict(type="RandomRotate", angle=[-1, 1], axis="x", always_apply=True, center=[0, 0, 0]),
        dict(type="RandomRotate", angle=[-1, 1], axis="y", always_apply=True, center=[0, 0, 0]),
        dict(type="RandomRotate", angle=[-1, 1], axis="z", always_apply=True, center=[0, 0, 0]),
        dict(type="ToTensor"),
        dict(type="Collect", keys=("coord", "energy"), feat_keys=("coord", "energy")),
    ]),
    # unlabelled use only: the reconstruction losses on events never trained on
    val=dict(type="LArTPCSynthDataset", num_events=32, split="val", in_memory=True, transform=[
        _log, _norm, dict(type="ToTensor"), dict(type="Collect", keys=("coord", "energy"), feat_keys=("coord", "energy"))]),
)
default_hooks = dict(information_writer=dict(log_frequency=25), checkpoint=dict(save_freq=100))
hooks = [
    dict(type="MAEEvaluator", every_n_steps=50, max_batches=4),
    dict(type="ParameterCounter", show_details=False, show_gradients=False, min_params=1),
    dict(type="WeightDecayExclusion", exclude_bias_from_wd=True, exclude_norm_from_wd=True,
         exclude_gamma_from_wd=True, exclude_token_from_wd=True, exclude_ndim_1_from_wd=True),
]
