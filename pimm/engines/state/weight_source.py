"""Where model weights come from: every form ``weight=``, ``tools/test.py`` and
:func:`pimm.from_pretrained` take, resolved to one readable source.

* a ``.pth`` file (a bare state dict, or one under ``state_dict`` / ``model``);
* a ``.safetensors`` file;
* an export folder (``model.safetensors``, or ``model.bin``; see
  :func:`pimm.save_pretrained`);
* a run directory (its ``model/model_best.pth``, else ``model/model_last.pth``);
* a checkpoint folder (``checkpoints/step...-epoch...``, whole or sharded), or a
  ``checkpoints/`` folder (its newest intact checkpoint);
* ``hf://org/name[@revision][/path/in/repo]``: a Hugging Face Hub model,
  through ``huggingface_hub``'s cache (the optional ``hub`` extra). Offline
  (``HF_HUB_OFFLINE=1``) it is read from the cache; not cached there, it is one
  error naming the model.

Every ``.pth`` is read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from pimm.engines.state.manager import MANIFEST
from pimm.engines.state.weight_file import read_weights, refuse_non_finite
from pimm.utils.errors import CheckpointError, ConfigError

__all__ = ["HF_SCHEME", "EXPORT_WEIGHT_NAMES", "WeightSource", "parse_hf_uri", "resolve_weight_source",
           "read_state_dict", "check_weight_option", "hf_cache_dir", "hf_offline"]

HF_SCHEME = "hf://"
EXPORT_WEIGHT_NAMES = ("model.safetensors", "model.bin")
_HF_URI = re.compile(r"hf://(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>[\w./-]+?))?(?:/(?P<file>.+))?")
_RUN_MODEL_FILES = ("model_best.pth", "model_last.pth")


@dataclass(frozen=True)
class WeightSource:
    """A resolved weight source: ``kind`` (``pth``, ``safetensors``,
    ``checkpoint``), ``path`` (the file or checkpoint folder to read), and
    ``folder``: the export folder or run directory it came from (where its
    config is), or None."""

    kind: str
    path: Path
    folder: Path | None = None
    origin: str = ""


def parse_hf_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``hf://org/name[@rev][/file]`` -> ``(org/name, rev or None, file or None)``."""
    match = _HF_URI.fullmatch(uri.strip())
    if match is None:
        raise ConfigError(f"{uri!r} is not a Hugging Face model name: write hf://org/name, hf://org/name@revision "
                          "or hf://org/name/path/to/file.safetensors")
    return match["repo"], match["rev"], match["file"]


def hf_cache_dir() -> str | None:
    """The Hugging Face cache in effect now: ``HF_HUB_CACHE``, else
    ``HF_HOME/hub``; None: huggingface_hub's default. Read at each call, because
    huggingface_hub reads these variables once, when it is imported."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def hf_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids the Hub now (read at each call, see :func:`hf_cache_dir`)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hf_download(uri: str, revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                 shown: str | None = None) -> Path:
    """The local path of ``uri`` in huggingface_hub's cache (downloaded when
    online). ``revision`` overrides the URI's; ``cache_dir``: the cache to use
    (default :func:`hf_cache_dir`); ``shown``: the name the user wrote."""
    repo, uri_revision, filename = parse_hf_uri(uri)
    revision, shown = revision or uri_revision, shown or uri
    try:
        import huggingface_hub
    except ImportError:
        raise ConfigError(f"{shown}: reading Hugging Face models needs huggingface_hub: pip install 'pimm[hub]' "
                          "(or give a local path)") from None
    offline = hf_offline()
    options = {"revision": revision}
    cache = os.fspath(cache_dir) if cache_dir is not None else hf_cache_dir()
    if cache is not None:
        options["cache_dir"] = cache
    if offline:
        options["local_files_only"] = True
    try:
        if filename:
            return Path(huggingface_hub.hf_hub_download(repo, filename, **options))
        return Path(huggingface_hub.snapshot_download(
            repo, allow_patterns=[*EXPORT_WEIGHT_NAMES, "*.json", "README.md"], **options))
    except Exception as err:  # offline and not cached, unknown repo, no network: many exception types
        name = type(err).__name__
        if offline or "LocalEntryNotFound" in name or "OfflineMode" in name or "Connect" in name:
            fetch = f"hf download {repo}" + (f" {filename}" if filename else "") + \
                (f" --revision {revision}" if revision else "")
            where = f" (cache: {cache})" if cache is not None else ""
            raise CheckpointError(f"model {shown} is not in the Hugging Face cache and the Hub cannot be reached"
                                  f"{' (HF_HUB_OFFLINE=1)' if offline else ''}; download it once online with "
                                  f"`{fetch}`{where}, or give a local path") from None
        first = str(err).splitlines()[0] if str(err) else ""
        raise CheckpointError(f"{shown}: cannot fetch model {repo} from the Hugging Face Hub ({name}: {first})") from None


def _from_folder(folder: Path, origin: str) -> WeightSource:
    if (folder / MANIFEST).is_file():
        from pimm.engines.state.manager import CheckpointManager

        verdict = CheckpointManager(folder.parent).verify(folder)  # a damaged file is named before anything reads it
        if verdict != "ok":
            raise CheckpointError(f"{origin}: checkpoint {folder.name} cannot be used: {verdict}; give another "
                                  "checkpoint of the run (or the run directory: its newest intact one)")
        return WeightSource("checkpoint", folder, folder.parent.parent, origin)
    for name in EXPORT_WEIGHT_NAMES:
        if (folder / name).is_file():
            return WeightSource("safetensors" if name.endswith(".safetensors") else "pth", folder / name, folder,
                                origin)
    for name in _RUN_MODEL_FILES:
        if (folder / "model" / name).is_file():
            return WeightSource("pth", folder / "model" / name, folder, origin)
    checkpoints = folder / "checkpoints" if (folder / "checkpoints").is_dir() else folder
    from pimm.engines.state.manager import CheckpointManager

    manager = CheckpointManager(checkpoints)
    for candidate in reversed(manager.committed()):
        if manager.verify(candidate) == "ok":
            return WeightSource("checkpoint", candidate, checkpoints.parent, origin)
    raise CheckpointError(f"{origin}: holds no model weights (looked for {', '.join(EXPORT_WEIGHT_NAMES)}, "
                          "model/model_best.pth, model/model_last.pth and committed checkpoints)")


def resolve_weight_source(weight: str | os.PathLike, *, revision: str | None = None,
                          cache_dir: str | os.PathLike | None = None, shown: str | None = None) -> WeightSource:
    """Resolve ``weight`` (see the module docstring); CheckpointError naming it
    (or ``shown``, the name the user wrote) if nothing readable is there.
    ``revision`` and ``cache_dir`` apply to ``hf://`` names (see :func:`_hf_download`)."""
    origin = str(weight)
    if origin.startswith(HF_SCHEME):
        local = _hf_download(origin, revision=revision, cache_dir=cache_dir, shown=shown)
        return _from_folder(local, origin) if local.is_dir() else _from_file(local, origin, local.parent)
    path = Path(os.path.expanduser(origin))
    if path.is_dir():
        return _from_folder(path, origin)
    if not path.exists():
        raise CheckpointError(f"weight={origin!r}: no such file or directory; give a .pth or .safetensors file, a "
                              "run directory, a checkpoint folder, an export folder or hf://org/name")
    folder = path.parent.parent if path.parent.name == "model" else path.parent
    return _from_file(path, origin, folder)


def _from_file(path: Path, origin: str, folder: Path | None) -> WeightSource:
    return WeightSource("safetensors" if path.suffix == ".safetensors" else "pth", path, folder, origin)


def read_state_dict(source: WeightSource) -> dict:
    """The model state dict of ``source``, on the CPU; refused when a tensor
    holds NaN or infinite values (:func:`~pimm.engines.state.weight_file.refuse_non_finite`)."""
    state = _read_state_dict(source)
    refuse_non_finite(state, f"weight={source.origin!r}")
    return state


def _read_state_dict(source: WeightSource) -> dict:
    if source.kind == "safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise CheckpointError(f"weight={source.origin!r}: reading .safetensors needs the safetensors package "
                                  "(pip install safetensors)") from None
        try:
            return load_file(str(source.path), device="cpu")
        except Exception as err:  # a damaged or foreign file
            first = str(err).splitlines()[0] if str(err) else ""
            raise CheckpointError(f"weight={source.origin!r}: {source.path} cannot be read as safetensors "
                                  f"({type(err).__name__}: {first})") from None
    if source.kind == "checkpoint":
        return _checkpoint_weights(source)
    return read_weights(source.path)


def _checkpoint_weights(source: WeightSource) -> dict:
    """The weights of a checkpoint folder (verified by :func:`_from_folder`), read as data."""
    from pimm.engines.state.convert import read_checkpoint_weights
    from pimm.engines.state.safe_load import UnsafeCheckpointError
    from pimm.engines.state.weight_file import CONVERT_HINT

    try:
        return read_checkpoint_weights(source.path)
    except UnsafeCheckpointError as err:
        raise CheckpointError(f"weight={source.origin!r} refused: {err.path} refers to {err.global_name}, and a "
                              "checkpoint may hold only data, never code; nothing in it was loaded or run; "
                              + CONVERT_HINT.format(source=source.path)) from None


def check_weight_option(key: str, value):
    """The runtime check of ``weight=``: None, ``hf://...`` (its syntax), or a path
    that exists (a file, or a folder holding weights)."""
    if value is None:
        return value
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ConfigError(f"{key}={value!r} is invalid: it takes a path, hf://org/name or None")
    value = str(value)
    if value.startswith(HF_SCHEME):
        parse_hf_uri(value)
        return value
    value = os.path.expanduser(value)
    if not Path(value).exists():
        raise ConfigError(f"{key}={value!r}: no such file or directory; give a .pth or .safetensors file, a run "
                          "directory, a checkpoint folder, an export folder or hf://org/name")
    if Path(value).is_dir():
        try:
            _from_folder(Path(value), value)
        except CheckpointError as err:
            raise ConfigError(f"{key}={err}") from None
    return value
