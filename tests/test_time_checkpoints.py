"""Wall-clock checkpoint cadence (``CheckpointSaver(save_every_minutes=...)``),
with an injected clock (``tests/support/clock.py``): one process reads its
clock every ``time_check_every`` steps; several processes save on rank 0's
clock alone, agreed in the stop control's all-reduce, all at the same step.
"""

from __future__ import annotations

import pytest

from pimm.engines.hooks.base import build_hooks
from pimm.utils.errors import RegistryError
from tests.support.inprocess import committed_steps, hook_of, make_trainer
from tests.support.run import run_tool, write_toy_config

# 192 samples, batch 16: 12 steps in the one epoch. The clock advances 20 s a step and is read every 2
# steps: 40 s at step 2, 80 s at step 4 (a save: 60 s passed), 40 s since it at step 6, 80 s at step 8
# (a save), then the epoch-end save at step 12.
HOOKS = ('[dict(type="FakeClock", seconds_per_step=20{speedup}), dict(type="InformationWriter", log_frequency=4),\n'
         ' dict(type="CheckpointSaver", save_every_minutes=1, time_check_every=2, keep_all=True)]')
EXPECTED = [4, 8, 12]


def test_one_process_saves_when_its_clock_says_the_cadence_is_due(tmp_path):
    trainer = make_trainer(tmp_path, HOOKS.format(speedup=""), extra='custom_imports = ["tests.support.toy", '
                           '"tests.support.clock"]\n', options=["data.train.num_samples=192"], epoch=1)
    saver = hook_of(trainer, "CheckpointSaver")
    assert saver.interval_s == 60.0
    trainer.train()
    assert committed_steps(tmp_path / "run") == EXPECTED
    assert saver.clock.now == 240.0  # the fake clock was the one read


def test_without_the_clock_advancing_only_the_epoch_end_saves(tmp_path):
    trainer = make_trainer(tmp_path, HOOKS.format(speedup="").replace("seconds_per_step=20", "seconds_per_step=0"),
                           extra='custom_imports = ["tests.support.toy", "tests.support.clock"]\n',
                           options=["data.train.num_samples=192"], epoch=1)
    trainer.train()
    assert committed_steps(tmp_path / "run") == [12]


@pytest.mark.slow
def test_several_processes_save_on_rank_0s_clock_at_the_same_step(tmp_path):
    # Rank 1's clock runs 100 times faster: were its clock asked, every check would save.
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, 'custom_imports = ["tests.support.toy", "tests.support.clock"]\n'
                           f'epoch = 1\nhooks = {HOOKS.format(speedup=", speedup={1: 100}")}\n')
    result = run_tool("train", cfg, "data.train.num_samples=192", num_gpus=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert committed_steps(save) == EXPECTED


def test_the_wall_clock_cadence_is_given_once_and_positive():
    with pytest.raises(RegistryError, match="give one wall-clock cadence"):
        build_hooks([dict(type="CheckpointSaver", save_every_minutes=5, save_every_seconds=60)])
    with pytest.raises(RegistryError, match="save_every_minutes must be a positive number"):
        build_hooks([dict(type="CheckpointSaver", save_every_minutes=0)])
    assert build_hooks([dict(type="CheckpointSaver", save_every_seconds=90)])[0].interval_s == 90
