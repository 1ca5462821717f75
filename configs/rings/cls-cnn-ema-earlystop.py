# Ring classification (configs/rings/cls-cnn.py) with the training-control
# hooks of docs/hooks.md: an EMA of the weights (evaluated as val_ema/*,
# exported as model/model_ema.pth) and early stopping on a plateau of the
# validation accuracy; live control through save_path/control.json (e.g.
# {"revision": 1, "lr": 1e-3} or {"revision": 2, "stop": "enough"}). The epoch
# budget is deliberately generous: the run stops by itself once the EMA
# model's accuracy (val_ema/acc, steadier than the raw model's val/acc) has
# not improved for `patience` evaluations. Measured: val_ema/acc 0.994,
# stopped at epoch 8 of 30 (25 s of training on 2 CPU cores); killed at step
# 210 and resumed, the run ends bit-identical (metrics.jsonl, model_last,
# model_ema, model_best).
_base_ = "./cls-cnn.py"

save_path = "exp/rings/cls-cnn-ema-earlystop"
epoch = 30
scheduler = dict(_delete_=True, type="CosineWarmupLR", warmup_ratio=0.02)

default_hooks = dict(live_control=dict(poll_every=10))  # the rest as in cls-cnn.py
hooks = [
    dict(type="ClsEvaluator", num_classes=2, class_names=["electron", "muon"]),
    dict(type="EMAHook", decay=0.99),
    dict(type="EarlyStopping", monitor="val_ema/acc", patience=3, min_delta=0.002),
]
