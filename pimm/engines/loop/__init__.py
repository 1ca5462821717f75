"""The training loop and everything it dispatches to, independent of models and data.

Owns: the epoch/step loop and hook dispatch (:mod:`.trainer_base`:
:class:`TrainerBase`), the start-up order of a config (:mod:`.prepare`), the
named default hooks every run gets (:mod:`.default_hooks`), the view upstream
hooks read on ``self.trainer`` (:mod:`.hook_contract`), the moments the host
may wait for the device (:mod:`.sync_points`), the end-of-run summary
(:mod:`.run_summary`) and the testers that score weights on ``data.test``
(:mod:`.testers`; upstream's import paths :mod:`.train` and :mod:`.test`).

Public surface: ``TrainerBase``, ``prepare_config``, ``Tester`` / ``TesterBase``,
``DEFAULT_HOOKS``. To add a trainer, subclass ``TrainerBase`` (or a trainer in
:mod:`pimm.engines.trainers`) and register it in ``TRAINERS``.

This ``__init__`` imports nothing: each module is imported by its own path, so
importing one piece does not pull in the rest.
"""
