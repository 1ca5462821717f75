"""Class vocabulary shared by evaluators: how many classes, their names, the
ignore label -- given to the evaluator or taken from the data config.

Upstream pimm's evaluators take no class arguments at all: they read
``cfg.data.num_classes``, ``cfg.data.names`` and ``cfg.data.ignore_index``
(``data`` is the same dict that holds ``train`` / ``val`` / ``test``). pimm
accepts both spellings. A value given to the evaluator wins; one left out
(``None``) is filled from ``cfg.data`` in :meth:`HookBase.modify_config`,
which the trainer calls after building the hooks and before anything else, so
a hook list such as ``[dict(type="SemSegEvaluator")]`` works unchanged.

:class:`ClassesFromData` is the mixin that does this for an evaluator; an
evaluator opts in by listing it before its base class and storing whatever it
was given with :func:`check_classes` (explicit values are checked at once, so
a wrong config fails while it is being built)::

    class MyEvaluator(ClassesFromData, EvaluatorBase):
        def __init__(self, num_classes=None, class_names=None, ignore_index=None, ...):
            self.num_classes, self.class_names = check_classes("MyEvaluator", num_classes, class_names)
            self.ignore_index = ignore_index  # None: data.ignore_index, else -1

Such an evaluator scores the model's logits, so once its classes are known
they are checked against the classes the model predicts (the model class's
``output_classes``, see :func:`check_model_classes`): a 3-way head scored as
2 classes is one line at start-up, not a run that trains without a word. An
evaluator that scores something else (a probe of its own) sets
``scores_model_classes = False``.
"""

from __future__ import annotations

from typing import Any, Sequence

from pimm.utils.config_domains import ask_class
from pimm.utils.errors import ConfigError

__all__ = ["ClassesFromData", "check_classes", "check_model_classes", "resolve_class_names", "DEFAULT_IGNORE_INDEX"]

#: The ignore label when neither the evaluator nor ``data.ignore_index`` sets one.
DEFAULT_IGNORE_INDEX = -1


def _check_num_classes(owner: str, num_classes: Any, source: str = "num_classes") -> int:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes <= 0:
        raise ConfigError(f"{owner}: {source} must be a positive integer, got {num_classes!r}")
    return num_classes


def _check_names(owner: str, names: Any, num_classes: int, source: str = "class_names") -> list[str]:
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise ConfigError(f"{owner}: {source} must be a list of names, got {names!r}")
    names = [str(n) for n in names]
    if len(names) != num_classes:
        raise ConfigError(f"{owner}: {source} has {len(names)} names for num_classes={num_classes}; "
                          "give one name per class")
    if len(set(names)) != len(names):
        # Names become metric keys (iou_<name>); duplicates would overwrite each other.
        raise ConfigError(f"{owner}: {source} must be unique, got {names}")
    return names


def resolve_class_names(owner: str, num_classes: Any, class_names: Sequence[str] | None) -> list[str]:
    """Validate an explicit ``num_classes`` / ``class_names`` pair and return one
    name per class (``"0"``, ``"1"``, ... when no names are given)."""
    num_classes = _check_num_classes(owner, num_classes)
    if class_names is None:
        return [str(i) for i in range(num_classes)]
    return _check_names(owner, class_names, num_classes)


def check_classes(owner: str, num_classes: Any, class_names: Sequence[str] | None):
    """What an evaluator constructor stores: ``(num_classes, names)`` with every
    given value validated now and missing ones left ``None`` for
    :meth:`ClassesFromData.modify_config`. Names without a count fix the count."""
    if num_classes is None:
        if class_names is None:
            return None, None
        if isinstance(class_names, str) or not isinstance(class_names, (list, tuple)):
            raise ConfigError(f"{owner}: class_names must be a list of names, got {class_names!r}")
        num_classes = len(class_names)
    num_classes = _check_num_classes(owner, num_classes)
    names = None if class_names is None else _check_names(owner, class_names, num_classes)
    return num_classes, names


def _data_get(data: Any, key: str) -> Any:
    return data.get(key) if isinstance(data, dict) else None


def check_model_classes(owner: str, num_classes: int, source: str, model_cfg: Any) -> None:
    """Refuse a model whose logits have another number of columns than the
    ``num_classes`` the evaluator ``owner`` scores (``source`` says where that
    number came from). The model's class declares its count
    (``output_classes``); a model that declares none is not checked."""
    predicted = ask_class(model_cfg, "model", "output_classes")
    if isinstance(predicted, int) and not isinstance(predicted, bool) and predicted != num_classes:
        kind = model_cfg.get("type") if isinstance(model_cfg, dict) else None
        name = kind if isinstance(kind, str) else getattr(kind, "__name__", "the model")
        raise ConfigError(f"{owner} scores {num_classes} classes ({source}) but the model {name} predicts "
                          f"{predicted}: give the model and the evaluator the same number of classes")


class ClassesFromData:
    """Evaluator mixin: fill ``num_classes``, ``class_names`` and
    ``ignore_index`` left ``None`` from ``cfg.data`` (see the module doc).

    After :meth:`modify_config` ``num_classes`` is an int, ``class_names`` one
    name per class (``data.names`` when it describes the same classes, else
    ``"0"``, ``"1"``, ...) and ``ignore_index`` an int.
    """

    num_classes: int | None = None
    class_names: list[str] | None = None
    ignore_index: int | None = None
    #: Whether ``num_classes`` counts the columns of the model's logits (False: a probe's own classes).
    scores_model_classes = True
    #: Where ``num_classes`` came from, for messages (set by :meth:`resolve_classes`).
    classes_source = "its num_classes"

    def modify_config(self, cfg) -> None:
        super().modify_config(cfg)
        self.resolve_classes(cfg.get("data"))
        if self.scores_model_classes:
            check_model_classes(type(self).__name__, self.num_classes, self.classes_source, cfg.get("model"))

    def resolve_classes(self, data: Any) -> None:
        owner = type(self).__name__
        data_classes = _data_get(data, "num_classes")
        data_names = _data_get(data, "names")
        if data_classes is not None:
            data_classes = _check_num_classes(owner, data_classes, source="data.num_classes")
        if data_names is not None:
            data_names = _check_names(owner, data_names, data_classes or len(data_names), source="data.names")
        self.classes_source = f"its num_classes={self.num_classes}"
        if self.num_classes is None:
            self.num_classes = data_classes or (len(data_names) if data_names else None)
            self.classes_source = f"data.num_classes={data_classes}" if data_classes else "data.names"
        if self.num_classes is None:
            raise ConfigError(f"{owner} does not know the number of classes: give it num_classes=K "
                              "or set data.num_classes (and data.names) in the config")
        if self.class_names is None:
            same = data_names is not None and len(data_names) == self.num_classes
            self.class_names = list(data_names) if same else [str(i) for i in range(self.num_classes)]
        if self.ignore_index is None:
            data_ignore = _data_get(data, "ignore_index")
            self.ignore_index = DEFAULT_IGNORE_INDEX if data_ignore is None else data_ignore
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ConfigError(f"{owner}: ignore_index must be an integer, got {self.ignore_index!r}")

    def require_classes(self) -> None:
        """Raise the 'unknown number of classes' error for an evaluator that
        was never configured (built outside a trainer without num_classes)."""
        if self.num_classes is None or self.class_names is None or self.ignore_index is None:
            self.resolve_classes(None)
