"""The ``compile`` runtime key: torch.compile as a switch (pimm/engines/compile.py).

Compiled runs go through tools/train.py on the toy task; inductor on a CPU
compiles C++ (gcc), which takes tens of seconds per process on this machine,
so the end-to-end runs are marked slow.
"""

from __future__ import annotations

import pytest
import torch

from pimm.engines.optim.compile import check_compile, compile_model
from pimm.utils.errors import ConfigError
from tests.support.run import ROOT, non_log_lines, run_tool, write_toy_config
from tests.test_resume import SIGKILLED, STARTUP_S, Run, assert_clean_losses, assert_same_weights

COMPILED = ("compile.enabled=True",)


@pytest.mark.parametrize("value,culprit", [
    ("yes", "compile='yes'"), (dict(enabled=1), "compile.enabled=1"), (dict(mode="fast"), "compile.mode='fast'"),
    (dict(dynamic="auto"), "compile.dynamic='auto'"), (dict(fulgraph=True), "unknown option 'fulgraph'"),
    (dict(backend=""), "compile.backend=''"),
])
def test_bad_compile_values_are_one_line_config_errors(value, culprit):
    with pytest.raises(ConfigError) as err:
        check_compile("compile", value)
    assert culprit in str(err.value) and "\n" not in str(err.value)


def test_compile_key_normalises_and_unknown_backend_is_named():
    assert check_compile("compile", True)["enabled"] is True
    assert check_compile("compile", dict(mode="max-autotune"))["enabled"] is False
    model = torch.nn.Linear(2, 2)
    assert compile_model(model, dict(enabled=False), "Linear") is model
    with pytest.raises(ConfigError, match="compile.backend='nope' is not a torch.compile backend"):
        compile_model(model, dict(enabled=True, backend="nope"), "Linear")


def test_compiled_module_keeps_plain_state_dict_and_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    compiled = compile_model(model, dict(enabled=True, backend="aot_eager"), "Sequential")
    x = torch.randn(5, 4)
    assert torch.allclose(compiled(x), model(x))
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_a_model_that_cannot_compile_fails_in_one_line_naming_it(tmp_path):
    config = write_toy_config(tmp_path, tmp_path / "run", 'custom_imports = ["tests.support.toy", '
                              '"tests.support.compile_models"]\nmodel = dict(type="BranchyMLP")\n')
    result = run_tool("train", config, "epoch=1", "compile.enabled=True", "compile.fullgraph=True",
                      "compile.backend='eager'")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = non_log_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: compile: model BranchyMLP cannot be compiled"), lines
    assert "fullgraph=False" in lines[0]
    assert "Traceback" in (tmp_path / "run" / "train.log").read_text()  # the details are in the log


def test_a_trainer_without_compile_support_refuses_the_key_in_one_line(tmp_path):
    # GRPOTrainer's rollouts call policy methods that torch.compile does not wrap.
    result = run_tool("train", ROOT / "configs" / "grpo" / "tracks-grpo.py", f"save_path={tmp_path / 'run'}",
                      "compile.enabled=True")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = non_log_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(
        "error: trainer GRPOTrainer: compile: this trainer does not support torch.compile"), lines
    assert "compile=dict(enabled=False)" in lines[0]


@pytest.mark.slow
def test_compiled_run_sigkill_resume_is_bit_identical_and_files_load_without_compile(tmp_path):
    ref = Run(tmp_path, "ref")
    # The log is quiet while inductor compiles at the first step: minutes on a loaded 2-core machine, not a deadlock.
    ref.stall_s = STARTUP_S
    ref.train(*COMPILED)
    assert "torch.compile: ToyMLP" in ref.log()
    run = Run(tmp_path, "killed")
    run.stall_s = STARTUP_S
    run.train(*COMPILED, "hooks.KillAtStep.step=17", "resume=True", "hooks.CheckpointSaver.async_write=False",
              expect=SIGKILLED)
    assert max(run.committed()) == 15
    run.train(*COMPILED, "resume=True", "hooks.CheckpointSaver.async_write=False")
    assert_same_weights(run, ref)
    assert_clean_losses(run, ref)
    # No torch.compile prefixes anywhere: the checkpoint resumes, and the weights load, in an eager run.
    eager = Run(tmp_path, "eager")
    eager.copy_from(run)
    eager.train("resume=True", "epoch=4")
    assert "Resumed from" in eager.log()
    keys = torch.load(eager.save / "model" / "model_last.pth", weights_only=True)["state_dict"]
    assert not [k for k in keys if "_orig_mod" in k]
