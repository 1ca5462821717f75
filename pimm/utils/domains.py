"""What each argument of a registered type may be: its *domain*.

Every constructor argument a config can set — of a model, loss, hook,
trainer, evaluator, tester, transform, data set, collate function, optimizer
or scheduler — has a declared domain: its type, range, finiteness, the names
it takes. Relations between arguments (``epsilon_high >= epsilon``, one entry
per stage) are :class:`Rule` s. :mod:`pimm.utils.config_domains` checks a
resolved config against them before anything is built, so a bad value is one
line naming the key, the value and what it takes (exit 2), never a crash at
the first batch or a silently degenerate run.

How a type declares them (docs/config.md has a copyable example)::

    @HOOKS.register_module()
    class MyHook(HookBase):
        domains = dict(every=PosInt, decay=Real(0, 1), mode=Choice("min", "max"), name=Text)
        domain_rules = (Rule(lambda a: a.low <= a.high, "high", "a value >= low"),)

        def __init__(self, every=10, decay=0.99, mode="min", name="x", verbose=False): ...

Why a class-level ``domains`` dict rather than ``Annotated[...]`` in the
signature: the declaration sits right above the ``__init__`` it describes,
leaves the signature (and its diff) alone, is inherited by subclasses (which
add only their own arguments; the dicts along the MRO are merged), and costs
nothing at import. A class pimm does not own (``torch.optim.AdamW``) or a
function (a collate function) gets the same dict through
``register_module(domains=...)``. The type part is inferred only where it is
all there is to say: an argument whose default is ``True``/``False`` takes a
bool and needs no entry; every other argument must be listed
(``tests/test_domains.py`` walks every registry to keep that true).

A domain is any callable ``check(key, value) -> value`` that raises a
one-line :class:`~pimm.utils.errors.ConfigError` — the same contract as the
runtime keys' checks (:mod:`pimm.engines.run.runtime`), so both are one mechanism.
Numbers are always finite (``nan``/``inf`` are refused wherever a number is
expected) and bounded by a stated range: a value no run could mean (``10**12``
channels, a learning rate of ``1e30``) is refused, not trained on.
"""

from __future__ import annotations

import math
import numbers
import os
import signal as _signal
from types import SimpleNamespace
from typing import Any, Callable, Iterable

from .errors import ConfigError

__all__ = ["Domain", "Number", "Real", "Int", "Choice", "Text", "FilePath", "Seq", "Pair", "DictOf", "Registered",
           "Anything", "Instance", "OneOf", "Signal", "Rule", "ConfigRule", "same_length", "Bool", "Null", "Prob",
           "Positive", "NonNeg", "PosInt", "Count", "Size", "LR", "Weight", "Length", "Steps", "Key", "Keys", "Names",
           "CollateFn", "Transforms", "MAX_SIZE", "MAX_COUNT", "MAX_REAL", "as_domain", "show"]

# Sanity caps: far above anything a run means, far below what overflows or never ends.
MAX_COUNT = 10**9
MAX_SIZE = 1 << 16
MAX_REAL = 1e9


def show(value: Any) -> str:
    """``value`` as a config would write it, cut to one short line."""
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


class Domain:
    """A set of values an argument takes. ``what`` says it in words (it ends the
    error line); ``accepts`` tells membership. ``Domain | None`` also takes None."""

    what = "a value"

    def accepts(self, value: Any) -> bool:
        raise NotImplementedError

    def __call__(self, key: str, value: Any) -> Any:
        if not self.accepts(value):
            raise ConfigError(f"{key}={show(value)} is invalid: it takes {self.what}")
        return value

    def __or__(self, other: Any) -> "OneOf":
        return OneOf(self, other)

    def __ror__(self, other: Any) -> "OneOf":
        return OneOf(other, self)

    def __repr__(self) -> str:
        return f"<{self.what}>"


class Instance(Domain):
    def __init__(self, kinds: type | tuple[type, ...], what: str):
        self.kinds, self.what = kinds, what

    def accepts(self, value):
        return isinstance(value, self.kinds) and not (bool not in _tuple(self.kinds) and isinstance(value, bool))


def _tuple(kinds):
    return kinds if isinstance(kinds, tuple) else (kinds,)


class _Null(Domain):
    what = "None"

    def accepts(self, value):
        return value is None


Null = _Null()
Bool = Instance(bool, "True or False")


def _num(value: float) -> str:
    if isinstance(value, int) and abs(value) < 10**7:
        return str(value)
    return f"{value:g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


class Number(Domain):
    """A finite number (never a bool) in ``[lo, hi]`` (``lo_open``/``hi_open``: excluded)."""

    def __init__(self, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                 hi_open: bool = False, integer: bool = False):
        self.lo, self.hi, self.lo_open, self.hi_open, self.integer = lo, hi, lo_open, hi_open, integer
        noun = "an integer" if integer else "a finite number"
        if lo is not None and hi is not None:
            self.what = f"{noun} in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
        elif lo is not None:
            self.what = f"{noun} {'>' if lo_open else '>='} {_num(lo)}"
        elif hi is not None:
            self.what = f"{noun} {'<' if hi_open else '<='} {_num(hi)}"
        else:
            self.what = noun

    def accepts(self, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        if self.integer and not isinstance(value, numbers.Integral):
            return False
        if not self.integer and not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))


def Real(lo: float | None = None, hi: float | None = MAX_REAL, **kw) -> Number:
    return Number(lo, hi, **kw)


def Int(lo: int | None = None, hi: int | None = MAX_COUNT) -> Number:
    return Number(lo, hi, integer=True)


class Choice(Domain):
    """One of the given names (strings, or other literals)."""

    def __init__(self, *choices: Any):
        self.choices = choices
        self.what = "one of " + ", ".join(map(repr, choices))

    def accepts(self, value):
        return any(type(value) is type(c) and value == c for c in self.choices)


class Text(Domain):
    """A non-empty string (``empty=True``: also '')."""

    def __init__(self, what: str = "a non-empty string", empty: bool = False):
        self.what, self.empty = what, empty

    def accepts(self, value):
        return isinstance(value, str) and (self.empty or bool(value))


class _FilePath(Domain):
    what = "a path"

    def accepts(self, value):
        return isinstance(value, (str, os.PathLike)) and bool(str(value))


FilePath = _FilePath()


class Seq(Domain):
    """A list or tuple of ``item`` (``length``: exactly that many; ``min_len``/``max_len``)."""

    def __init__(self, item: Any, length: int | None = None, min_len: int = 0, max_len: int | None = None,
                 what: str | None = None):
        self.item, self.length, self.min_len, self.max_len = as_domain(item), length, min_len, max_len
        count = f"a list of {length}" if length is not None else "a non-empty list" if min_len == 1 else "a list"
        self.what = what or f"{count}, each {self.item.what}"

    def accepts(self, value):
        if not isinstance(value, (list, tuple)):
            return False
        if self.length is not None and len(value) != self.length:
            return False
        if len(value) < self.min_len or (self.max_len is not None and len(value) > self.max_len):
            return False
        return all(self.item.accepts(v) for v in value)


class Pair(Seq):
    """``(low, high)`` with ``low <= high``."""

    def __init__(self, item: Any):
        super().__init__(item, length=2)
        self.what = f"a pair (low, high) with low <= high, each {self.item.what}"

    def accepts(self, value):
        return super().accepts(value) and value[0] <= value[1]


class DictOf(Domain):
    def __init__(self, key: Any = None, value: Any = None, what: str | None = None):
        self.key = as_domain(key) if key is not None else None
        self.value = as_domain(value) if value is not None else None
        self.what = what or "a dict" + (f" of {self.value.what}" if self.value is not None else "")

    def accepts(self, value):
        return isinstance(value, dict) and all(
            (self.key is None or self.key.accepts(k)) and (self.value is None or self.value.accepts(v))
            for k, v in value.items())


class Registered(Domain):
    """A ``dict(type=...)`` built from the registry named ``registry`` (its keys are checked where it sits)."""

    def __init__(self, registry: str):
        self.registry = registry
        self.what = f"a dict(type=...) naming a registered {registry}"

    def accepts(self, value):
        kind = value.get("type") if isinstance(value, dict) else None
        return isinstance(kind, str) or callable(kind)


class Anything(Domain):
    """Any value; ``why`` says why nothing narrower applies (kept for reviewers)."""

    def __init__(self, why: str):
        self.why, self.what = why, "any value"

    def accepts(self, value):
        return True


class OneOf(Domain):
    def __init__(self, *options: Any):
        self.options = [as_domain(o) for o in options]
        self.what = " or ".join(o.what for o in self.options)

    def accepts(self, value):
        return any(o.accepts(value) for o in self.options)


# Catchable signals of the platforms pimm runs on (Linux, macOS/BSD, Windows), for
# options that a config may carry from one platform to another (SIGINFO is BSD's).
_PORTABLE_SIGNALS = frozenset((
    "SIGHUP", "SIGINT", "SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGIOT", "SIGBUS", "SIGEMT", "SIGFPE",
    "SIGUSR1", "SIGSEGV", "SIGUSR2", "SIGPIPE", "SIGALRM", "SIGTERM", "SIGSTKFLT", "SIGCHLD", "SIGCLD", "SIGCONT",
    "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGURG", "SIGXCPU", "SIGXFSZ", "SIGVTALRM", "SIGPROF", "SIGWINCH", "SIGIO",
    "SIGPOLL", "SIGPWR", "SIGSYS", "SIGINFO", "SIGLOST", "SIGBREAK"))


class Signal(Domain):
    """A signal name a process can catch (never SIGKILL/SIGSTOP): one this platform
    has, or with ``portable=True`` one of any platform pimm runs on (the option's
    owner then says what it does where the platform lacks it)."""

    what = "the name of a signal a process can catch, like 'SIGTERM' or 'SIGUSR2' (not SIGKILL or SIGSTOP)"

    def __init__(self, portable: bool = False):
        self.portable = portable

    def accepts(self, value):
        if not isinstance(value, str) or value in ("SIGKILL", "SIGSTOP"):
            return False
        here = value.startswith("SIG") and not value.startswith("SIG_") and isinstance(
            getattr(_signal, value, None), _signal.Signals)
        return here or (self.portable and value in _PORTABLE_SIGNALS)


def as_domain(spec: Any) -> Domain:
    """A domain from a declaration: a Domain, None (only None), or a Python type."""
    if isinstance(spec, Domain):
        return spec
    if spec is None:
        return Null
    if spec is bool:
        return Bool
    if spec is int:
        return Int()
    if spec is float:
        return Real()
    if spec is str:
        return Text()
    if isinstance(spec, type):
        return Instance(spec, f"a {spec.__name__}")
    if callable(spec):  # a check(key, value) function, e.g. a runtime key's
        return _Check(spec)
    raise TypeError(f"not a domain: {spec!r}")


class _Check(Domain):
    def __init__(self, check: Callable[[str, Any], Any]):
        self.check, self.what = check, getattr(check, "__doc__", None) or "a valid value"

    def accepts(self, value):
        try:
            self.check("value", value)
        except ConfigError:
            return False
        return True

    def __call__(self, key, value):
        return self.check(key, value)


class Rule:
    """A relation between arguments: ``test(args)`` (the arguments as attributes,
    defaults filled in) must hold, else ``key`` is reported as taking ``what``.
    Runs only once every argument is in its own domain."""

    def __init__(self, test: Callable[[SimpleNamespace], bool], key: str, what: str):
        self.test, self.key, self.what = test, key, what

    def check(self, args: dict, where: str) -> None:
        try:
            holds = self.test(SimpleNamespace(**args))
        except AttributeError:  # a required argument the config leaves out: the constructor names it
            return
        if not holds:
            raise ConfigError(f"{where}{self.key}={show(args.get(self.key))} is invalid: it takes {self.what}")


class ConfigRule(Rule):
    """A relation between a type's arguments and the rest of the config: the
    data a model trains on, the model whose output an evaluator reads. The
    declaring type owns the knowledge (which key of the other section matters
    and what agreeing means); :func:`pimm.utils.config_domains.check_config_domains`
    calls ``check_config(args, cfg, where)`` with the whole resolved config.
    ``check_config`` raises a one-line ConfigError itself (it names keys of
    two sections)."""

    def __init__(self, key: str):
        super().__init__(lambda a: True, key, "")

    def check(self, args: dict, where: str) -> None:  # without the config there is nothing to relate
        return

    def check_config(self, args: dict, cfg: dict, where: str) -> None:
        raise NotImplementedError


def same_length(*names: str, offset: dict[str, int] | None = None,
                when: Callable[[SimpleNamespace], bool] | None = None) -> Rule:
    """One entry per stage: every list in ``names`` as long as the first
    (``offset``: a name whose list is that many entries longer/shorter);
    ``when``: only for arguments where it holds (e.g. a model with a decoder)."""
    return _PerStage(names, offset or {}, when)


class _PerStage(Rule):
    def __init__(self, names: Iterable[str], offset: dict[str, int], when):
        self.names, self.offset, self.when = tuple(names), offset, when
        super().__init__(lambda a: True, self.names[0], "")

    def check(self, args: dict, where: str) -> None:
        if self.when is not None and not self.when(SimpleNamespace(**args)):
            return
        n = len(args[self.names[0]])
        for name in self.names[1:]:
            want = n + self.offset.get(name, 0)
            if len(args[name]) != want:
                raise ConfigError(f"{where}{name}={show(args[name])} is invalid: it takes one entry per stage, "
                                  f"{want} ({self.names[0]} has {n})")


# The vocabulary most declarations need.
Prob = Real(0, 1)
Positive = Real(0, MAX_REAL, lo_open=True)
NonNeg = Real(0, MAX_REAL)
PosInt = Int(1)
Count = Int(0)
Size = Int(1, MAX_SIZE)  # channels, widths, hidden units
LR = Real(0, 10)  # a learning rate (0: frozen)
Weight = Real(0, 1e6)  # a loss weight
Length = Real(0, 1e6, lo_open=True)  # a physical size (cm, mm, voxels)
Steps = PosInt | None  # an interval in steps; None: never
Key = Text("a key name (a non-empty string)")
Keys = Seq(Key, what="a list of key names")
Names = Seq(Key, min_len=1, what="a non-empty list of names")
CollateFn = Text("a COLLATE_FNS name") | Registered("collate function") | None
Transforms = Seq(Registered("transform"), what="a list of dict(type=...) naming registered transforms") | None
