"""Upstream pimm's two probe hooks for self-supervised pre-training, with
upstream's arguments and meaning.

* :class:`OnlineLinearProbe` -- trains a LayerNorm + Linear classifier on the
  detached per-point features the model stashes on itself
  (``model._probe_feat``, labels ``model._probe_segment_motif``) after every
  step, with its own AdamW; every ``log_frequency`` probe steps logs the
  running accuracy, loss and per-class / macro precision, recall and F1
  under ``<prefix>/``. It never touches the backbone's gradients.
* :class:`EventLinearProbeEvaluator` -- after each epoch (or every
  ``every_n_steps``), mean-pools the point features of every validation
  event (``model(batch, return_point=True)["point"].feat``), splits the
  events per class into probe-train / held-out (``train_fraction``, seeded),
  trains a grid of linear classifiers (one per learning rate of
  ``train_config``), keeps the one with the best macro F1, and logs
  ``<prefix>/val/mIoU``, ``mPrecision``, ``mRecall``, ``mF1`` (and per class
  ``cls_<i>-<name> IoU`` / ``F1``); ``mF1`` is published as the metric that
  selects ``model_best`` (upstream's ``current_metric_*``).

Neither draws from the training RNG streams (their own generators), so a run
with a probe resumes exactly; the online probe's weights, optimizer and
running counts are part of every checkpoint.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.utils import comm
from pimm.utils.domains import (MAX_SIZE, Choice, Count, DictOf, Int, Key, LR, Names, NonNeg, PosInt, Prob, Real,
                                Registered, Seq, Text)
from pimm.utils.errors import ConfigError

__all__ = ["OnlineLinearProbe", "EventLinearProbeEvaluator", "class_scores"]


def class_scores(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
    """Per-class IoU, precision, recall and F1 (0 where undefined) and support."""
    conf = torch.zeros(num_classes, num_classes, dtype=torch.float64)
    conf.index_put_((target.long(), pred.long()), torch.ones(len(target), dtype=torch.float64), accumulate=True)
    tp, in_pred, in_target = conf.diagonal(), conf.sum(0), conf.sum(1)

    def ratio(a, b):
        return torch.where(b > 0, a / b.clamp(min=1e-12), torch.zeros_like(a))

    precision, recall = ratio(tp, in_pred), ratio(tp, in_target)
    return dict(iou=ratio(tp, in_pred + in_target - tp), precision=precision, recall=recall,
                f1=ratio(2 * precision * recall, precision + recall), support=in_target, confusion=conf)


@HOOKS.register_module()
class OnlineLinearProbe(HookBase):
    """See the module doc. ``weight``: per-class cross-entropy weights."""

    domains = dict(num_classes=Int(1, MAX_SIZE), lr=LR, weight_decay=Real(0, 10), log_frequency=PosInt,
                   prefix=Key, class_names=Names | None, weight=Seq(NonNeg, min_len=1) | None)

    def __init__(self, num_classes: int = 5, lr: float = 1e-3, weight_decay: float = 1e-6, log_frequency: int = 10,
                 prefix: str = "online_probe", class_names: Sequence[str] | None = None,
                 weight: Sequence[float] | None = None):
        if weight is not None and len(weight) != num_classes:
            raise ConfigError(f"OnlineLinearProbe: weight has {len(weight)} values for num_classes={num_classes}")
        self.num_classes, self.lr, self.weight_decay = int(num_classes), float(lr), float(weight_decay)
        self.log_frequency, self.prefix = int(log_frequency), prefix
        self.class_names, self.weight = class_names, weight
        self.probe: nn.Module | None = None
        self.probe_optimizer = None
        self.step_count = 0
        self._reset_counts()

    def _reset_counts(self):
        self._correct, self._total = 0, 0
        self._tp = torch.zeros(self.num_classes)
        self._fp = torch.zeros(self.num_classes)
        self._fn = torch.zeros(self.num_classes)

    def _init_probe(self, feat_dim: int, device, dtype):
        with torch.random.fork_rng(devices=[]):  # the probe's init draws nothing from the run's streams
            torch.manual_seed(feat_dim)
            self.probe = nn.Sequential(nn.LayerNorm(feat_dim), nn.Linear(feat_dim, self.num_classes))
        self.probe.to(device=device, dtype=dtype)
        self.probe_optimizer = torch.optim.AdamW(self.probe.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        self.trainer.logger.info(f"OnlineLinearProbe: probe of {feat_dim} features -> {self.num_classes} classes")

    def after_step(self):
        model = self.trainer.model_without_ddp
        feat = getattr(model, "_probe_feat", None)
        labels = getattr(model, "_probe_segment_motif", None)
        if feat is None or labels is None:
            return
        feat, labels = feat.detach(), labels.detach().reshape(-1).long()
        if self.probe is None:
            self._init_probe(feat.shape[-1], feat.device, feat.dtype)
        weight = None if self.weight is None else torch.tensor(self.weight, dtype=feat.dtype, device=feat.device)
        with torch.enable_grad():
            logits = self.probe(feat)
            loss = F.cross_entropy(logits, labels, weight=weight)
            self.probe_optimizer.zero_grad()
            loss.backward()
            self.probe_optimizer.step()
        pred = logits.detach().argmax(dim=-1).cpu()
        labels = labels.cpu()
        self._correct += int((pred == labels).sum())
        self._total += labels.numel()
        for c in range(self.num_classes):
            p, t = pred == c, labels == c
            self._tp[c] += (p & t).sum()
            self._fp[c] += (p & ~t).sum()
            self._fn[c] += (~p & t).sum()
        self.step_count += 1
        if self.step_count % self.log_frequency == 0 and self._total:
            self._log(float(loss.detach()))

    def _log(self, loss: float):
        tp, fp, fn = self._tp, self._fp, self._fn
        precision = torch.where(tp + fp > 0, tp / (tp + fp).clamp(min=1), torch.zeros_like(tp))
        recall = torch.where(tp + fn > 0, tp / (tp + fn).clamp(min=1), torch.zeros_like(tp))
        f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-12),
                         torch.zeros_like(tp))
        p = self.prefix
        scalars = {f"{p}/accuracy": self._correct / self._total, f"{p}/loss": loss,
                   f"{p}/macro_recall": float(recall.mean()), f"{p}/macro_precision": float(precision.mean()),
                   f"{p}/macro_f1": float(f1.mean())}
        for c in range(self.num_classes):
            name = self.class_names[c] if self.class_names and c < len(self.class_names) else str(c)
            scalars.update({f"{p}/recall_{name}": float(recall[c]), f"{p}/precision_{name}": float(precision[c]),
                            f"{p}/f1_{name}": float(f1[c])})
        self.trainer.metrics.publish_local(scalars, step=self.trainer.global_step)
        self._reset_counts()

    def state_dict(self):
        state = {"step_count": self.step_count, "correct": self._correct, "total": self._total,
                 "tp": self._tp.clone(), "fp": self._fp.clone(), "fn": self._fn.clone()}
        if self.probe is not None:
            state["feat_dim"] = self.probe[0].normalized_shape[0]
            state["probe"] = self.probe.state_dict()
            state["optimizer"] = self.probe_optimizer.state_dict()
        return state

    def load_state_dict(self, state):
        self.step_count, self._correct, self._total = state["step_count"], state["correct"], state["total"]
        self._tp, self._fp, self._fn = state["tp"].clone(), state["fp"].clone(), state["fn"].clone()
        if "probe" in state:
            weight = state["probe"]["1.weight"]
            self._init_probe(int(state["feat_dim"]), weight.device, weight.dtype)
            self.probe.load_state_dict(state["probe"])
            self.probe_optimizer.load_state_dict(state["optimizer"])


_DEFAULT_LRS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)
_PROBE_KEYS = ("learning_rates", "epochs", "batch_size", "weight_decay", "criteria", "device")
_HELDOUT, _FORBIDDEN = {"holdout", "val", "test"}, {"train", "all"}


@HOOKS.register_module()
class EventLinearProbeEvaluator(HookBase):
    """See the module doc.

    Args:
        label_key: the batch key of the event's class (one per event, or per
            point: the event's first point's).
        every_n_steps: evaluate every N steps; 0: after every epoch.
        train_fraction: share of each class's held-out events that trains the probe.
        max_events_per_class: cap per class (None: all).
        seed: seed of the split and of the probes.
        prefix, class_names: metric prefix; names (default ``data.names``).
        train_config: ``learning_rates`` (a grid), ``epochs`` (10),
            ``batch_size`` (32768), ``weight_decay`` (0.01), ``criteria``
            (``CrossEntropyLoss``), ``device`` (ignored: the trainer's).
        write_cls_metrics: also log per-class IoU and F1.
        require_heldout_data: refuse to run unless ``data.val``'s split is
            ``val``/``test``/``holdout`` and differs from the training split.
    """

    domains = dict(label_key=Key, every_n_steps=Count, train_fraction=Real(0, 1, lo_open=True, hi_open=True),
                   max_events_per_class=Int(2) | None, seed=Int(0), prefix=Text(empty=True), class_names=Names | None,
                   train_config=DictOf(Choice(*_PROBE_KEYS), Seq(LR, min_len=1) | NonNeg | Registered("loss")
                                       | Text("a device name") | None,
                                       what="a dict among " + ", ".join(_PROBE_KEYS)) | None)

    def __init__(self, label_key: str = "event_label", every_n_steps: int = 0, train_fraction: float = 0.5,
                 max_events_per_class: int | None = None, seed: int = 0, prefix: str = "event_probe",
                 class_names: Sequence[str] | None = None, train_config: dict | None = None,
                 write_cls_metrics: bool = True, require_heldout_data: bool = True):
        if not 0.0 < float(train_fraction) < 1.0:
            raise ConfigError(f"EventLinearProbeEvaluator: train_fraction must be in (0, 1), got {train_fraction}")
        cfg = dict(train_config or {})
        unknown = set(cfg) - set(_PROBE_KEYS)
        if unknown:
            raise ConfigError(f"EventLinearProbeEvaluator: train_config has unknown key(s) {sorted(unknown)}; it "
                              f"takes {', '.join(_PROBE_KEYS)}")
        criteria = cfg.get("criteria", dict(type="CrossEntropyLoss"))
        if not isinstance(criteria, dict) or criteria.get("type") != "CrossEntropyLoss":
            raise ConfigError("EventLinearProbeEvaluator: train_config criteria must be dict(type='CrossEntropyLoss',"
                              " ...)")
        self.class_weight = criteria.get("weight")
        self.learning_rates = tuple(float(lr) for lr in cfg.get("learning_rates", _DEFAULT_LRS))
        self.epochs, self.batch_size = int(cfg.get("epochs", 10)), int(cfg.get("batch_size", 32768))
        self.weight_decay = float(cfg.get("weight_decay", 0.01))
        self.label_key, self.every_n_steps = label_key, int(every_n_steps)
        self.train_fraction, self.max_events_per_class = float(train_fraction), max_events_per_class
        self.seed, self.prefix = int(seed), str(prefix).strip("/")
        self.class_names, self.write_cls_metrics = class_names, bool(write_cls_metrics)
        self.require_heldout_data = bool(require_heldout_data)
        self.last_metrics: dict[str, float] = {}

    def after_step(self):
        if self.every_n_steps and self._active() and self.trainer.global_step % self.every_n_steps == 0:
            self.evaluate()

    def after_epoch(self):
        if not self.every_n_steps and self._active():
            self.evaluate()

    def _active(self) -> bool:
        return bool(self.trainer.cfg.evaluate) and self.trainer.val_loader is not None

    def _check_heldout(self):
        def split_of(loader):
            dataset = getattr(loader, "dataset", None)
            while hasattr(dataset, "dataset") and not hasattr(dataset, "split"):
                dataset = dataset.dataset
            split = getattr(dataset, "split", None)
            return {split} if isinstance(split, str) else (set(split) if split is not None else None)

        val, train = split_of(self.trainer.val_loader), split_of(getattr(self.trainer, "train_loader", None))
        if val is None:
            raise ConfigError("EventLinearProbeEvaluator: data.val has no split to check it is held out; set its "
                              "split, or require_heldout_data=False for a deliberate diagnostic run")
        if val & _FORBIDDEN or not val <= _HELDOUT or (train is not None and val & train):
            raise ConfigError(f"EventLinearProbeEvaluator: data.val's split {sorted(val)} is not held-out data "
                              f"(training split {sorted(train or [])}); use a val/test/holdout split")

    @torch.no_grad()
    def embeddings(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean-pooled point features and the class of every validation event."""
        trainer = self.trainer
        model = trainer.model_without_ddp
        was_training = model.training
        model.eval()
        xs, ys = [], []
        try:
            for batch in trainer.val_loader:
                if self.label_key not in batch:
                    raise ConfigError(f"EventLinearProbeEvaluator: the validation batch has no {self.label_key!r} "
                                      f"(keys: {sorted(batch)}); Collect it in data.val's transform")
                batch = {k: v.to(trainer.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                with trainer.autocast():
                    out = model(batch, return_point=True)
                if not isinstance(out, dict) or "point" not in out:
                    raise ConfigError(f"EventLinearProbeEvaluator: {type(model).__name__}(batch, return_point=True) "
                                      "returns no 'point'; use a model that does (DefaultSegmentorV2)")
                point = out["point"]
                feat = (point["feat"] if not isinstance(point, torch.Tensor) else point).float()
                offset = point.get("offset", batch["offset"]) if isinstance(point, dict) else batch["offset"]
                ends = [int(e) for e in offset.reshape(-1).tolist()]
                starts = [0] + ends[:-1]
                labels = batch[self.label_key].reshape(-1).long()
                per_point = labels.numel() == feat.shape[0] and labels.numel() != len(ends)
                for i, (s, e) in enumerate(zip(starts, ends)):
                    if e > s:
                        xs.append(feat[s:e].mean(0).cpu())
                        ys.append(labels[s if per_point else i].cpu())
        finally:
            model.train(was_training)
        if not xs:
            raise ConfigError("EventLinearProbeEvaluator: data.val gave no event")
        return torch.stack(xs), torch.stack(ys)

    def split(self, x: torch.Tensor, y: torch.Tensor):
        gen = torch.Generator().manual_seed(self.seed)
        classes = sorted(int(c) for c in y.unique().tolist())
        if len(classes) < 2:
            raise ConfigError(f"EventLinearProbeEvaluator: the held-out events hold one class only ({classes})")
        fit, score = [], []
        for c in classes:
            idx = torch.nonzero(y == c).flatten()
            idx = idx[torch.randperm(idx.numel(), generator=gen)]
            if self.max_events_per_class is not None:
                idx = idx[: int(self.max_events_per_class)]
            if idx.numel() < 2:
                raise ConfigError(f"EventLinearProbeEvaluator: class {c} has {idx.numel()} held-out event(s); at "
                                  "least 2 are needed (one to fit, one to score)")
            n = max(1, min(int(round(idx.numel() * self.train_fraction)), idx.numel() - 1))
            fit.append(idx[:n])
            score.append(idx[n:])
        fit, score = torch.cat(fit), torch.cat(score)
        return x[fit], y[fit], x[score], y[score]

    def fit_grid(self, x, y, num_classes: int) -> list[nn.Linear]:
        """One linear classifier per learning rate, trained together (upstream's grid)."""
        gen = torch.Generator().manual_seed(self.seed)
        heads = []
        for _ in self.learning_rates:
            head = nn.Linear(x.shape[1], num_classes)
            with torch.no_grad():
                head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * 0.01)
                head.bias.zero_()
            heads.append(head)
        opt = torch.optim.AdamW([dict(params=h.parameters(), lr=lr) for h, lr in zip(heads, self.learning_rates)],
                                weight_decay=self.weight_decay)
        weight = None if self.class_weight is None else torch.tensor(self.class_weight, dtype=torch.float32)
        with torch.enable_grad():
            for _ in range(self.epochs):
                for chunk in torch.randperm(len(x), generator=gen).split(self.batch_size):
                    loss = sum(F.cross_entropy(h(x[chunk]), y[chunk], weight=weight) for h in heads)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        return heads

    def evaluate(self) -> dict[str, float]:
        trainer = self.trainer
        if not comm.is_main_process():
            comm.synchronize()
            return {}
        if self.require_heldout_data:
            self._check_heldout()
        x, y = self.embeddings()
        x_fit, y_fit, x_score, y_score = self.split(x, y)
        names = self.class_names
        if names is None:
            data = trainer.cfg.get("data") if hasattr(trainer.cfg, "get") else None
            names = data.get("names") if isinstance(data, dict) else None
        num_classes = max(len(names) if names else 0, int(y.max()) + 1)
        names = list(names or []) + [str(i) for i in range(len(names or []), num_classes)]
        heads = self.fit_grid(x_fit, y_fit, num_classes)
        with torch.no_grad():
            results = [class_scores(h(x_score).argmax(1), y_score, num_classes) for h in heads]
        best = max(range(len(heads)), key=lambda i: float(results[i]["f1"].mean()))
        s = results[best]
        p = f"{self.prefix}/" if self.prefix else ""
        metrics = {f"{p}val/mIoU": float(s["iou"].mean()), f"{p}val/mPrecision": float(s["precision"].mean()),
                   f"{p}val/mRecall": float(s["recall"].mean()), f"{p}val/mF1": float(s["f1"].mean())}
        if self.write_cls_metrics:
            for c in range(num_classes):
                metrics[f"{p}val/cls_{c}-{names[c]} IoU"] = float(s["iou"][c])
                metrics[f"{p}val/cls_{c}-{names[c]} F1"] = float(s["f1"][c])
        trainer.metrics.publish_local(metrics, step=trainer.global_step)
        trainer.logger.info(f"EventLinearProbeEvaluator: {len(y_fit)} events fit, {len(y_score)} scored, best lr "
                            f"{self.learning_rates[best]:g}: mIoU {metrics[p + 'val/mIoU']:.4f}, "
                            f"mF1 {metrics[p + 'val/mF1']:.4f}")
        trainer.comm_info["current_metric_name"] = f"{self.prefix}/mF1" if self.prefix else "mF1"
        trainer.comm_info["current_metric_value"] = metrics[f"{p}val/mF1"]
        trainer.comm_info[f"{self.prefix}_current_metric_value"] = metrics[f"{p}val/mF1"]
        self.last_metrics = metrics
        if comm.get_world_size() > 1:
            comm.synchronize()
        return metrics
