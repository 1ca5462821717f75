"""``PushToHub``: upload a run's weights to the Hugging Face Hub during and
after training (upstream pimm's hook, arguments and meaning), through
``huggingface_hub`` (the ``hub`` extra).

It lives beside the evaluators because a push with ``weights_only`` off uploads a
``pimm export`` folder (:func:`pimm.export.save_pretrained`),
which the engine layer may not import.

Uploads run on rank 0. A failed upload is one warning line and the run goes
on, never a crash; without a network (or with ``HF_HUB_OFFLINE=1``) the line
says the Hub is unreachable and that nothing was pushed.
"""

from __future__ import annotations

import difflib
import math
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.utils import comm
from pimm.utils.domains import PosInt, Text
from pimm.utils.errors import ConfigError

__all__ = ["PushToHub"]

_OFFLINE_ERRORS = ("OfflineModeIsEnabled", "ConnectionError", "ConnectTimeout", "ReadTimeout", "NewConnectionError",
                   "MaxRetryError", "LocalEntryNotFoundError", "ConnectError", "TimeoutException")


def _is_offline(err: BaseException) -> bool:
    chain, seen = err, set()
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if type(chain).__name__ in _OFFLINE_ERRORS or isinstance(chain, (ConnectionError, TimeoutError)):
            return True
        chain = chain.__cause__ or chain.__context__
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


@HOOKS.register_module()
class PushToHub(HookBase):
    """Push ``<save_path>/model/<checkpoint>`` to ``hf://<repo_id>``.

    Args:
        repo_id: the Hub repository (``"org/name"``), created if missing
            (``private``).
        checkpoint: what ``on_train_end`` pushes: ``"model_best"`` (default),
            ``"last"``/``"model_last"``, an ``EMAHook``'s ``"model_ema"``, a file
            already under ``model/`` or an absolute path; anything else is
            refused when the config is read (:meth:`check_checkpoint`).
        weights_only: push the weight file as it is (loads back with
            ``weight=hf://<repo_id>/<file>``); ``False``: a ``pimm export`` folder.
        token, revision: Hub token (default: the ambient login) and branch.
        name: the file's name in the repository (default: its own).
        on_train_end: push ``checkpoint`` once training ends (blocking).
        on_best: push ``model_best`` whenever the best metric improves.
        every_n_epochs, every_n_steps: push ``model_last`` every N epochs / steps.
        background: periodic pushes in a background thread (one at a time).
        squash_history: squash the repository's history after the last push
            (reclaims the storage of replaced files; drops the history).
        squash_every_n_pushes: also squash after every N periodic pushes.
    """

    priority = "VERY_LOW"  # after the checkpoint saver wrote the files it reads
    domains = dict(repo_id=Text("an 'org/name' Hub repository"), checkpoint=Text("a checkpoint name or path"),
                   token=Text("a Hugging Face token") | None, revision=Text("a branch name") | None,
                   name=Text("a file name") | None, every_n_epochs=PosInt | None, every_n_steps=PosInt | None,
                   squash_every_n_pushes=PosInt | None)

    def __init__(self, repo_id: str, checkpoint: str = "model_best", weights_only: bool = True, private: bool = True,
                 token: str | None = None, revision: str | None = None, name: str | None = None,
                 on_train_end: bool = True, on_best: bool = False, every_n_epochs: int | None = None,
                 every_n_steps: int | None = None, background: bool = True, squash_history: bool = True,
                 squash_every_n_pushes: int | None = None):
        if not isinstance(repo_id, str) or repo_id.count("/") != 1 or not all(repo_id.split("/")):
            raise ConfigError(f"PushToHub: repo_id must be 'org/name', got {repo_id!r}")
        try:
            import huggingface_hub  # noqa: F401
        except ImportError:
            raise ConfigError("PushToHub needs huggingface_hub: pip install 'pimm[hub]' (or remove the hook)") from None
        self.repo_id, self.checkpoint, self.weights_only, self.private = repo_id, checkpoint, bool(weights_only), \
            bool(private)
        self.token, self.revision, self.name = token, revision, name
        self.on_train_end, self.on_best, self.background = bool(on_train_end), bool(on_best), bool(background)
        self.every_n_epochs, self.every_n_steps = every_n_epochs, every_n_steps
        self.squash_history, self.squash_every_n_pushes = bool(squash_history), squash_every_n_pushes
        self._api = None
        self._repo_ready = False
        self._seen_best = None
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self.pushed: list[str] = []  # hf:// addresses pushed by this process, in order
        self._periodic_pushes = 0
        self._gave_up = False

    # -- the Hub -------------------------------------------------------------
    def api(self):
        if self._api is None:
            from huggingface_hub import HfApi

            self._api = HfApi(token=self.token)
        return self._api

    def _ensure_repo(self):
        if not self._repo_ready:
            self.api().create_repo(repo_id=self.repo_id, repo_type="model", private=self.private, exist_ok=True)
            self._repo_ready = True

    def _upload(self, local: Path) -> str:
        self._ensure_repo()
        if self.weights_only:
            path_in_repo = self.name or local.name
            self.api().upload_file(path_or_fileobj=str(local), path_in_repo=path_in_repo, repo_id=self.repo_id,
                                   repo_type="model", revision=self.revision,
                                   commit_message=f"pimm: {path_in_repo} at step {self.trainer.global_step}")
            return f"hf://{self.repo_id}/{path_in_repo}"
        from pimm.export.saving import save_pretrained

        with tempfile.TemporaryDirectory() as tmp:
            # The run's config as published: this hook's token, other secrets and paths redacted.
            save_pretrained(str(local), tmp, cfg=self.trainer.cfg)
            self.api().upload_folder(folder_path=tmp, repo_id=self.repo_id, repo_type="model", revision=self.revision,
                                     commit_message=f"pimm export of {local.name} at step {self.trainer.global_step}")
        return f"hf://{self.repo_id}"

    def _guarded(self, local: Path) -> str | None:
        try:
            address = self._upload(local)
        except Exception as err:  # noqa: BLE001  (a failed upload must never end the run)
            if _is_offline(err):
                self.trainer.logger.warning(f"PushToHub: the Hub is unreachable (offline): {local.name} not pushed "
                                            f"to {self.repo_id}; the run continues")
            else:
                self.trainer.logger.warning(f"PushToHub: pushing {local.name} to {self.repo_id} failed "
                                            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''});"
                                            " the run continues")
            return None
        self.pushed.append(address)
        self.trainer.logger.info(f"PushToHub: pushed {local.name} to {address}")
        return address

    def _squash(self):
        try:
            self.api().super_squash_history(repo_id=self.repo_id, repo_type="model", branch=self.revision)
        except Exception as err:  # noqa: BLE001
            self.trainer.logger.warning(f"PushToHub: squashing the history of {self.repo_id} failed "
                                        f"({type(err).__name__}); the run continues")

    # -- which file ------------------------------------------------------------
    def modify_config(self, cfg) -> None:
        self.check_checkpoint(cfg)

    def check_checkpoint(self, cfg) -> None:
        """Refuse a ``checkpoint`` that names nothing the run writes or holds (a
        typo would otherwise train the whole run and push nothing): it must be
        ``model_best``, ``last``/``model_last``, the model file of an ``EMAHook``
        of the config (``model_ema``), a file already under ``save_path/model``,
        or an absolute path to a file."""
        name = self.checkpoint
        written = {"model_best", "model_last", "last"}
        for entry in list(cfg.get("hooks") or []) + list((cfg.get("default_hooks") or {}).values()):
            if isinstance(entry, dict) and entry.get("type") == "EMAHook" and entry.get("export", True):
                written.add(f"model_{entry.get('name', 'ema')}")
        stem = name[:-len(".pth")] if name.endswith(".pth") else name
        if stem in written or (Path(name).is_absolute() and Path(name).is_file()):
            return
        model_dir = Path(str(cfg.get("save_path") or ".")) / "model"
        if not Path(name).is_absolute() and ((model_dir / name).is_file() or (model_dir / f"{name}.pth").is_file()):
            return
        choices = sorted(written - {"last"})
        close = difflib.get_close_matches(stem, choices, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"PushToHub: checkpoint={name!r} names nothing this run writes ({hint}it takes "
                          f"{', '.join(repr(c) for c in choices)}, 'last', a file already under {model_dir} or an "
                          "absolute path to a weight file)")

    def resolve(self, name: str) -> Path | None:
        model_dir = Path(self.trainer.cfg.save_path) / "model"
        if name in ("last", "model_last"):
            name = "model_last.pth"
        candidates = [Path(name)] if Path(name).is_absolute() else [model_dir / name]
        if not Path(name).suffix:
            candidates.append(candidates[0].with_name(candidates[0].name + ".pth"))
        return next((p for p in candidates if p.is_file()), None)

    def _push(self, name: str, blocking: bool) -> None:
        if not comm.is_main_process():
            return
        checkpointer = getattr(self.trainer, "checkpointer", None)
        if checkpointer is not None:  # an asynchronous save writes model_last.pth / model_best.pth in a thread
            checkpointer.wait()
        local = self.resolve(name)
        if local is None:
            self.trainer.logger.warning(f"PushToHub: no {name!r} under {Path(self.trainer.cfg.save_path) / 'model'} "
                                        "yet; nothing pushed")
            return
        if blocking or not self.background:
            self._guarded(local)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pimm-push-to-hub")
        # A snapshot: the saver may replace the file while the upload runs.
        snapshot = Path(tempfile.mkdtemp(prefix="pimm-push-")) / local.name
        snapshot.write_bytes(local.read_bytes())
        self._futures.append(self._pool.submit(self._push_snapshot, snapshot))

    def _push_snapshot(self, snapshot: Path):
        try:
            return self._guarded(snapshot)
        finally:
            snapshot.unlink(missing_ok=True)
            snapshot.parent.rmdir()

    def _periodic(self, name: str):
        self._push(name, blocking=False)
        self._periodic_pushes += 1
        if self.squash_every_n_pushes and self._periodic_pushes % self.squash_every_n_pushes == 0:
            self._drain()
            if comm.is_main_process():
                self._squash()

    def _drain(self):
        for future in self._futures:
            future.result()
        self._futures.clear()

    # -- phases ----------------------------------------------------------------
    def before_train(self):
        self._seen_best = self.trainer.best_metric_value

    def after_step(self):
        trainer = self.trainer
        if self.on_best:
            best = trainer.best_metric_value
            if best != self._seen_best and isinstance(best, float) and math.isfinite(best):
                self._seen_best = best
                self._periodic("model_best")
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:  # steps done so far
            self._periodic("model_last")

    def after_epoch(self):
        if self.every_n_epochs and (self.trainer.epoch + 1) % self.every_n_epochs == 0:
            self._periodic("model_last")

    def after_train(self):
        try:
            self._drain()
            if self.on_train_end and self.trainer.outcome in ("completed", "stopped"):
                self._push(self.checkpoint, blocking=True)
            if self.squash_history and self.pushed and comm.is_main_process():
                self._squash()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
