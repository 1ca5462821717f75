"""``torch.compile`` as a switch: the ``compile`` runtime key.

``compile = dict(enabled=True, mode=None, dynamic=None, fullgraph=False,
backend="inductor")`` runs the training forward and backward through
``torch.compile`` (the options are ``torch.compile``'s own). What is compiled
is the module the loss goes through (after DDP/FSDP wrapping, the order
PyTorch documents); the model the checkpoints, ``model_last.pth``, EMA and
evaluation read stays the plain module, so no file ever holds
``_orig_mod.``-prefixed keys and a run saved with compile resumes or loads
without it and the other way round.

Compilation is lazy: it happens at the first forward pass (and again when the
input shapes change; ``dynamic=None`` lets torch mark shapes dynamic after the
first change). A model ``torch.compile`` cannot handle (an unsupported
construct under ``fullgraph=True``, a backend failure such as a missing C++
compiler for inductor on a CPU) stops the run with one ``error:`` line naming
the model and the way out, exit 2 (a config choice, fixed in the config), the
traceback in train.log. An error of the model itself, which eager mode would
raise too, is not reported as a compile failure.
"""

from __future__ import annotations

import difflib

import functools
import logging

import torch
from torch import nn

from pimm.utils.errors import ConfigError, UserError

__all__ = ["DEFAULT_COMPILE", "check_compile", "compile_model"]

DEFAULT_COMPILE = dict(enabled=False, mode=None, dynamic=None, fullgraph=False, backend="inductor")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_compile(key: str, value) -> dict:
    """The runtime-key check: the normalised ``compile`` dict, or a one-line ConfigError."""
    if isinstance(value, bool):  # compile=True is the obvious shorthand
        value = dict(enabled=value)
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={value!r} is invalid: it takes a dict, e.g. dict(enabled=True, mode='default')")
    unknown = [k for k in value if k not in DEFAULT_COMPILE]
    if unknown:
        raise ConfigError(f"{key}: unknown option {unknown[0]!r}; the options are {', '.join(DEFAULT_COMPILE)}")
    out = {**DEFAULT_COMPILE, **value}
    for name in ("enabled", "fullgraph"):
        if not isinstance(out[name], bool):
            raise ConfigError(f"{key}.{name}={out[name]!r} is invalid: it takes True or False")
    if out["mode"] is not None and out["mode"] not in MODES:
        raise ConfigError(f"{key}.mode={out['mode']!r} is invalid: it takes None or one of "
                          f"{', '.join(map(repr, MODES))}")
    if out["dynamic"] not in (None, True, False):
        raise ConfigError(f"{key}.dynamic={out['dynamic']!r} is invalid: it takes None (decide per shape change), "
                          "True or False")
    if not isinstance(out["backend"], str) or not out["backend"]:
        raise ConfigError(f"{key}.backend={out['backend']!r} is invalid: it takes a backend name like 'inductor'")
    if out["enabled"]:
        _check_backend(key, out["backend"])
    return out


def _check_backend(key: str, backend: str) -> None:
    """Every backend torch.compile takes, the debugging ones (eager, aot_eager) included."""
    from torch._dynamo import list_backends

    names = list_backends(exclude_tags=())
    if backend not in names:
        shown = sorted(set(list_backends()) | {n for n in ("eager", "aot_eager") if n in names})
        near = difflib.get_close_matches(backend, shown, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(f"{key}.backend={backend!r} is not a torch.compile backend; {hint}it takes one of "
                          f"{', '.join(map(repr, shown))}")


def compile_model(module: nn.Module, options: dict | None, name: str,
                  logger: logging.Logger | None = None) -> nn.Module:
    """``torch.compile(module, ...)`` when ``options['enabled']`` (else
    ``module``). ``name`` names the model in errors. The returned wrapper's
    forward turns a compilation failure into a one-line UserError."""
    options = check_compile("compile", options if options is not None else DEFAULT_COMPILE)
    if not options["enabled"]:
        return module
    backend = options["backend"]
    compiled = torch.compile(module, mode=options["mode"], dynamic=options["dynamic"],
                             fullgraph=options["fullgraph"], backend=backend)
    compiled.forward = _naming_failures(compiled.forward, name, options, logger)
    if logger is not None:
        settings = ", ".join(f"{k}={options[k]!r}" for k in ("mode", "dynamic", "fullgraph", "backend"))
        logger.info(f"torch.compile: {name} ({settings}); it compiles at the first step")
    return compiled


def _naming_failures(forward, name: str, options: dict, logger: logging.Logger | None):
    from torch._dynamo.exc import TorchDynamoException, TorchRuntimeError

    @functools.wraps(forward)
    def checked(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        except TorchRuntimeError:
            raise  # the model's own error, met while tracing: eager mode raises it too
        except TorchDynamoException as err:
            if logger is not None:
                from pimm.utils.logger import FILE_ONLY

                logger.error(f"torch.compile failed on {name}", exc_info=True, extra=FILE_ONLY)
            detail = next((line for line in str(err).splitlines() if line.strip()), "")
            hint = " or fullgraph=False" if options["fullgraph"] else ""
            raise UserError(f"compile: model {name} cannot be compiled by torch.compile ({type(err).__name__}: "
                            f"{detail[:300]}); set compile=dict(enabled=False){hint} to train it eagerly; "
                            "traceback in train.log") from err
    return checked
