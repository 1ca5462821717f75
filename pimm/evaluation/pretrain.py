"""Hooks that watch self-supervised pre-training of a point model (upstream's
names): an online linear probe of the frozen features on labelled
validation events, and the two collapse monitors.

* :class:`PretrainEvaluator` -- every ``every_n_steps``: per-point features
  of the teacher backbone (or the model's ``backbone``), every encoder level
  concatenated back onto the input points (a Sonata with representation
  fusion: its fused features, ``model(batch, return_point=True)``, as
  upstream), for the first
  ``max_train_events`` validation events (probe training) and the next
  ``max_test_events`` (probe scoring); a linear classifier is fitted on the
  first set and scored on the second: ``val/mIoU``, ``val/mF1``,
  ``val/mPrecision``, ``val/mRecall``, ``val/allAcc`` and per class
  ``val/iou_<name>`` (``write_cls_iou``).
* :class:`PrototypeUsageLogger` -- the student heads' prototype assignments
  (argmax): ``used_count``, ``unused_percent``, ``tokens_per_prototype``,
  ``assignment_entropy`` under ``<prefix>/student/<head>/``.
* :class:`FeatureStdMonitor` -- the spread of the backbones' output
  features: ``global_std``, ``batch_std`` (per point across channels),
  ``channel_mean_std`` / ``channel_min_std`` / ``channel_max_std`` under
  ``<prefix>/<student|teacher>/``.

docs/pretraining.md says how to read them.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.evaluation.common import ClassesFromData
from pimm.evaluation.metrics import confusion_matrix, segmentation_scores
from pimm.utils.domains import MAX_SIZE, Choice, Count, DictOf, Int, Key, Names, NonNeg, PosInt, Registered, Seq, Text
from pimm.utils.errors import ConfigError

__all__ = ["PretrainEvaluator", "PrototypeUsageLogger", "FeatureStdMonitor", "point_level_features"]


def _frequency(value, who: str, name: str = "log_frequency", allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise ConfigError(f"{who}: {name}={value!r} must be a {'non-negative' if allow_zero else 'positive'} integer")
    return value


# The keys of PretrainEvaluator's train_config (its docstring says what each sets).
_PROBE_OPTIONS = ("criteria", "lr", "epochs", "batch_size", "max_samples_per_class", "weight_decay")


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def point_level_features(point) -> torch.Tensor:
    """Per input point: the features of every level of an encoder output,
    each coarser level's copied onto its children and concatenated."""
    if isinstance(point, torch.Tensor):
        return point
    feat = point["feat"]
    while "pooling_parent" in point:
        parent = point["pooling_parent"]
        feat = torch.cat([parent["feat"], feat.index_select(0, point["pooling_inverse"])], dim=-1)
        point = parent
    return feat


def _student_teacher(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    return getattr(model, "student", None), getattr(model, "teacher", None)


class _ArmedForwardHooks(HookBase):
    """Forward hooks that record only on the steps numbered ``log_frequency``,
    ``2 * log_frequency``, ... (1-based), once per module and step."""

    domains = dict(log_frequency=PosInt, prefix=Key)

    def __init__(self, log_frequency: int, prefix: str):
        self.log_frequency = _frequency(log_frequency, type(self).__name__)
        self.prefix = prefix
        self._handles: list = []
        self._pending: set[str] = set()
        self._model: nn.Module | None = None

    def targets(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        raise NotImplementedError

    def stats(self, output) -> dict[str, float] | None:
        raise NotImplementedError

    def before_train(self) -> None:
        self._model = self.trainer.model_without_ddp
        targets = self.targets(self._model)
        if not targets:
            raise ConfigError(f"{type(self).__name__}: the model ({type(self._model).__name__}) has none of the "
                              "modules it watches (a student/teacher model such as Sonata-v1m1)")
        for name, module in targets:
            self._handles.append(module.register_forward_hook(self._recorder(name)))

    def _recorder(self, name: str):
        def record(module, args, output):
            if name not in self._pending or not module.training:
                return
            self._pending.discard(name)
            with torch.no_grad():
                stats = self.stats(output)
            if stats:
                step = self.trainer.global_step + 1
                self.trainer.metrics.publish({f"{self.prefix}/{name}/{k}": v for k, v in stats.items()}, step=step)
        return record

    def before_step(self) -> None:
        if (self.trainer.global_step + 1) % self.log_frequency == 0:
            self._pending = {name for name, _ in self.targets(self._model)}

    def after_train(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@HOOKS.register_module()
class PrototypeUsageLogger(_ArmedForwardHooks):
    """Prototype usage of the student's heads (see the module doc)."""

    def __init__(self, log_frequency: int = 10, prefix: str = "prototypes", log_pooling_levels: bool = False):
        super().__init__(log_frequency, prefix)
        del log_pooling_levels  # upstream's per-level point counts: not logged here

    def targets(self, model):
        student, _ = _student_teacher(model)
        if not isinstance(student, nn.ModuleDict):
            return []
        return [(f"student/{name}", m) for name, m in student.items() if "head" in name]

    def stats(self, logits) -> dict[str, float] | None:
        if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
            return None
        k = logits.shape[-1]
        counts = _all_reduce(torch.bincount(logits.argmax(dim=-1), minlength=k).double())
        total = float(counts.sum())
        used = int((counts > 0).sum())
        probs = counts / total if total > 0 else counts
        entropy = float(-(probs * torch.log(probs + 1e-10)).sum())
        return dict(used_count=float(used), unused_percent=100.0 * (k - used) / k,
                    tokens_per_prototype=total / used if used else 0.0, assignment_entropy=entropy)


@HOOKS.register_module()
class FeatureStdMonitor(_ArmedForwardHooks):
    """Feature spread of the student's and teacher's backbones (see the module doc)."""

    def __init__(self, log_frequency: int = 10, prefix: str = "feature_std", monitor_student: bool = True,
                 monitor_teacher: bool = True, track_channels: bool = False):
        super().__init__(log_frequency, prefix)
        self.monitor = dict(student=bool(monitor_student), teacher=bool(monitor_teacher))
        self.track_channels = bool(track_channels)

    def targets(self, model):
        out = []
        for role, net in zip(("student", "teacher"), _student_teacher(model)):
            if self.monitor[role] and isinstance(net, nn.ModuleDict) and "backbone" in net:
                out.append((role, net["backbone"]))
        return out

    def stats(self, output) -> dict[str, float] | None:
        feat = output["feat"] if isinstance(output, dict) and "feat" in output else output
        if not isinstance(feat, torch.Tensor) or feat.ndim != 2 or feat.shape[0] < 2:
            return None
        x = feat.double()
        sums = _all_reduce(torch.cat([x.new_tensor([x.shape[0]]), x.sum(0), (x * x).sum(0)]))
        n, channels = sums[0], x.shape[1]
        mean, sq = sums[1:1 + channels] / n, sums[1 + channels:] / n
        channel_std = (sq - mean * mean).clamp(min=0).sqrt()
        total_mean = mean.mean()
        global_std = float((sq.mean() - total_mean * total_mean).clamp(min=0).sqrt())
        out = dict(global_std=global_std, batch_std=float(x.std(dim=1).mean()),
                   channel_mean_std=float(channel_std.mean()), channel_min_std=float(channel_std.min()),
                   channel_max_std=float(channel_std.max()))
        if self.track_channels:
            out.update({f"channel_{i}_std": float(v) for i, v in enumerate(channel_std)})
        return out


@HOOKS.register_module()
class PretrainEvaluator(ClassesFromData, HookBase):
    """Online linear probe of the frozen features (see the module doc).

    Args:
        label: the per-point label key to probe (``segment``).
        every_n_steps: probe every N steps; 0: after every epoch.
        max_train_events / max_test_events: validation events fitting / scoring the probe.
        train_config: ``criteria`` (``CrossEntropyLoss`` entries; ``weight``
            gives class weights), ``lr`` (1e-2), ``epochs`` (20), ``batch_size``
            (4096 points), ``max_samples_per_class`` (20000 training points per class).
        write_cls_iou: log ``val/iou_<class>`` as well.
        class_names / num_classes / ignore_index: default from ``data``.
    """

    domains = dict(label=Key, every_n_steps=Count, max_train_events=PosInt, max_test_events=PosInt,
                   class_names=Names | None, prefix=Text(empty=True), num_classes=Int(1, MAX_SIZE) | None,
                   ignore_index=Int(-1, MAX_SIZE) | None,
                   train_config=DictOf(Choice(*_PROBE_OPTIONS), Seq(Registered("loss")) | NonNeg,
                                       what="a dict of criteria (a list of loss dicts) and numbers >= 0 among "
                                            + ", ".join(_PROBE_OPTIONS[1:])) | None)
    scores_model_classes = False  # the probe has its own head: the data's classes, whatever the model predicts

    def __init__(self, label: str = "segment", write_cls_iou: bool = True, every_n_steps: int = 1,
                 max_train_events: int = 250, max_test_events: int = 250, class_names: Sequence[str] | None = None,
                 prefix: str = "", train_config: dict | None = None, num_classes: int | None = None,
                 ignore_index: int | None = None):
        if not isinstance(label, str):
            raise ConfigError(f"PretrainEvaluator: label={label!r}; give one label key (several: one hook each)")
        self.label, self.write_cls_iou = label, bool(write_cls_iou)
        self.every_n_steps = _frequency(every_n_steps, "PretrainEvaluator", "every_n_steps", allow_zero=True)
        self.max_train_events, self.max_test_events = int(max_train_events), int(max_test_events)
        self.class_names, self.num_classes, self.ignore_index = class_names, num_classes, ignore_index
        self.prefix = prefix.rstrip("/") + "/" if prefix else "val/"
        cfg = dict(train_config or {})
        unknown = set(cfg) - set(_PROBE_OPTIONS)
        if unknown:
            raise ConfigError(f"PretrainEvaluator: train_config has unknown key(s) {sorted(unknown)}")
        self.class_weight = None
        for criterion in cfg.get("criteria") or []:
            if not isinstance(criterion, dict) or criterion.get("type") != "CrossEntropyLoss":
                raise ConfigError(f"PretrainEvaluator: train_config criteria {criterion!r}: only "
                                  "dict(type='CrossEntropyLoss', weight=[...]) is supported")
            if criterion.get("weight") is not None:
                self.class_weight = torch.tensor(criterion["weight"], dtype=torch.float32)
        self.lr, self.epochs = float(cfg.get("lr", 1e-2)), int(cfg.get("epochs", 20))
        self.batch_size = int(cfg.get("batch_size", 4096))
        self.max_per_class = int(cfg.get("max_samples_per_class", 20000))
        self.weight_decay = float(cfg.get("weight_decay", 0.0))
        self.last_metrics: dict[str, float] = {}

    def after_step(self) -> None:
        if self.every_n_steps and self.trainer.cfg.evaluate and self.trainer.global_step % self.every_n_steps == 0:
            self.evaluate()

    def after_epoch(self) -> None:
        if not self.every_n_steps and self.trainer.cfg.evaluate:
            self.evaluate()

    def backbone(self) -> nn.Module:
        model = self.trainer.model_without_ddp
        _, teacher = _student_teacher(model)
        if isinstance(teacher, nn.ModuleDict) and "backbone" in teacher:
            return teacher["backbone"]
        if isinstance(getattr(model, "backbone", None), nn.Module):
            return model.backbone
        raise ConfigError(f"PretrainEvaluator: the model ({type(model).__name__}) has no teacher backbone or "
                          "backbone to probe")

    def encoder(self):
        """The module to run in eval mode and how it turns a batch into per-point features."""
        model = self.trainer.model_without_ddp
        if getattr(model, "representation_fusion_enabled", False):  # the fused features live outside the backbone
            return model.teacher, lambda inputs: model(inputs, return_point=True)["point"]["feat"]
        backbone = self.backbone()
        return backbone, lambda inputs: point_level_features(backbone(inputs))

    @torch.no_grad()
    def features(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-event features and labels of the first train+test events of ``data.val``."""
        (backbone, encode), device = self.encoder(), self.trainer.device
        was_training = backbone.training
        backbone.eval()
        feats, labels, wanted = [], [], self.max_train_events + self.max_test_events
        try:
            for batch in self.trainer.val_loader:
                if self.label not in batch:
                    raise ConfigError(f"PretrainEvaluator: the validation batch has no {self.label!r} (keys: "
                                      f"{sorted(batch)}); Collect it in data.val's transform")
                batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                inputs = {k: v for k, v in batch.items() if k in ("feat", "coord", "grid_coord", "offset",
                                                                   "grid_size")}
                with self.trainer.autocast():
                    feat = encode(inputs).float()
                ends = batch["offset"].tolist()
                for start, end in zip([0] + ends[:-1], ends):
                    feats.append(feat[start:end].cpu())
                    labels.append(batch[self.label][start:end].reshape(-1).long().cpu())
                if len(feats) >= wanted:
                    break
        finally:
            backbone.train(was_training)
        return feats[:wanted], labels[:wanted]

    def _fit(self, x: torch.Tensor, y: torch.Tensor) -> nn.Linear:
        gen = torch.Generator().manual_seed(0)  # the probe never touches the training RNG streams
        keep = []
        for c in range(self.num_classes):
            idx = torch.nonzero(y == c).flatten()
            keep.append(idx[torch.randperm(len(idx), generator=gen)[: self.max_per_class]])
        keep = torch.cat(keep)
        x, y = x[keep], y[keep]
        mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
        probe = nn.Linear(x.shape[1], self.num_classes)
        with torch.no_grad():
            init = torch.randn(probe.weight.shape, generator=gen) * 0.01
            probe.weight.copy_(init)
            probe.bias.zero_()
        opt = torch.optim.AdamW(probe.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        weight = self.class_weight / self.class_weight.sum() * self.num_classes if self.class_weight is not None \
            else None
        xs = (x - mean) / std
        for _ in range(self.epochs):
            for chunk in torch.randperm(len(xs), generator=gen).split(self.batch_size):
                loss = F.cross_entropy(probe(xs[chunk]), y[chunk], weight=weight)
                opt.zero_grad()
                loss.backward()
                opt.step()
        probe.normalization = (mean, std)
        return probe

    def evaluate(self) -> dict[str, float]:
        trainer = self.trainer
        feats, labels = self.features()
        if len(feats) <= self.max_train_events:
            raise ConfigError(f"PretrainEvaluator: data.val has {len(feats)} events, fewer than max_train_events="
                              f"{self.max_train_events} + 1; lower max_train_events")
        train_x, train_y = torch.cat(feats[: self.max_train_events]), torch.cat(labels[: self.max_train_events])
        test_x, test_y = torch.cat(feats[self.max_train_events:]), torch.cat(labels[self.max_train_events:])
        if self.class_weight is not None and len(self.class_weight) != self.num_classes:
            raise ConfigError(f"PretrainEvaluator: criteria weight has {len(self.class_weight)} values for "
                              f"{self.num_classes} classes")
        valid = train_y != self.ignore_index
        with torch.enable_grad():
            probe = self._fit(train_x[valid], train_y[valid])
        mean, std = probe.normalization
        with torch.no_grad():
            pred = probe((test_x - mean) / std).argmax(dim=1)
        conf = confusion_matrix(pred, test_y, self.num_classes, self.ignore_index)
        scores = segmentation_scores(conf)
        c = conf.double()
        hit, in_pred, in_target = c.diagonal(), c.sum(0), c.sum(1)
        present = in_target > 0
        precision = torch.where(in_pred > 0, hit / in_pred.clamp(min=1), torch.zeros_like(hit))
        recall = hit / in_target.clamp(min=1)
        f1 = torch.where(in_pred + in_target > 0, 2 * hit / (in_pred + in_target).clamp(min=1), torch.zeros_like(hit))
        p = self.prefix
        metrics = {f"{p}mIoU": scores["mIoU"], f"{p}allAcc": scores["allAcc"],
                   f"{p}mPrecision": float(precision[present].mean()) if present.any() else math.nan,
                   f"{p}mRecall": float(recall[present].mean()) if present.any() else math.nan,
                   f"{p}mF1": float(f1[present].mean()) if present.any() else math.nan}
        if self.write_cls_iou:
            metrics.update({f"{p}iou_{name}": v for name, v in zip(self.class_names, scores["iou"])})
        trainer.metrics.publish(metrics, step=trainer.global_step)
        trainer.logger.info(f"PretrainEvaluator (linear probe, {self.max_train_events} events fit, "
                            f"{len(feats) - self.max_train_events} scored): mIoU {scores['mIoU']:.4f}, "
                            f"mF1 {metrics[p + 'mF1']:.4f}")
        self.last_metrics = metrics
        return metrics
