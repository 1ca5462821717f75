# Stage 2 of docs/pretraining.md, full fine-tune: the encoder pre-trained by
# configs/lartpc/pretrain-sonata.py plus a decoder, everything trained on 1% of
# the labels (30 events; upstream's "fft" recipe). Without `weight` it is the
# same model trained from scratch on the same labels: the baseline.
#
#   python tools/train.py --config-file configs/lartpc/finetune-sonata-fft.py \
#       --options weight=exp/lartpc/pretrain-sonata/model/model_last.pth
#   python tools/train.py --config-file configs/lartpc/finetune-sonata-fft.py \
#       --options save_path=exp/lartpc/finetune-sonata-scratch          # baseline
_base_ = "finetune-sonata-lin.py"

save_path = "exp/lartpc/finetune-sonata-fft"
epoch = 20  # not the linear probe's 100: every weight trains here
eval_epoch = 4  # evaluate every 5 epochs
model = dict(
    backbone_out_channels=32,
    backbone=dict(
        enc_mode=False,
        dec_depths=(1, 1, 1),
        dec_channels=(32, 48, 64),
        dec_num_head=(2, 3, 4),
        dec_patch_size=(64, 64, 64),
    ),
    freeze_backbone=False,
)
optimizer = dict(type="AdamW", lr=2e-3, weight_decay=0.05)
scheduler = dict(type="OneCycleLR", max_lr=2e-3, pct_start=0.05, anneal_strategy="cos", div_factor=10.0,
                 final_div_factor=1000.0)
