"""A run as a process: from the command line to a trainer with its data, devices and run directory.

Owns: the command line behind ``tools/train.py`` / ``tools/test.py`` and
``pimm train|test`` (:mod:`.launch`), the runtime keys with their defaults and
checks (:mod:`.runtime`), the run directory and its records (:mod:`.run_dir`,
:mod:`.run_records`), which config a resume runs (:mod:`.resume_config`), how
the model is spread over processes (:mod:`.parallel`) and the data loaders
(:mod:`.data`).

Public surface: ``launch.main`` / ``load_config`` / ``build_trainer`` /
``build_tester``, ``RUNTIME_KEYS`` / ``RUNTIME_DEFAULTS``, ``build_train_loader``
/ ``build_eval_loader``. A new runtime key is declared in :mod:`.runtime`.

This ``__init__`` imports nothing: each module is imported by its own path.
"""
