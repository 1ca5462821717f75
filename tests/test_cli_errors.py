"""Bad input to tools/train.py and tools/test.py: exit code 2, one ``error:``
line on stderr that names the culprit, no traceback (SPEC, "Exit codes").

Every case is a real process, forked from a server that imported torch and
pimm once (``tests/support/forkserver.py``: importing them was most of each
case's cost). The module fixture runs all selected cases concurrently (a few
at a time) once, and each parametrized test then checks its own result.
"""

from __future__ import annotations

import hashlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support import forkserver  # noqa: E402
from tests.support.run import non_log_lines  # noqa: E402
from tests.support.run import env as tool_env  # noqa: E402
from tests.support.run import write_toy_config  # noqa: E402

PARALLEL = 3


@dataclass
class Case:
    """One bad invocation. ``culprits`` must all appear in the error line."""

    id: str
    culprits: tuple[str, ...]
    options: tuple[str, ...] = ()
    extra: str = ""  # Python appended to the toy config
    tool: str = "train"
    num_gpus: int | None = None
    argv: tuple[str, ...] = ()  # extra raw command-line tokens
    config: Callable[[Path], Path] | None = None  # builds a special config file instead of the toy one
    setup: Callable[[Path], None] | None = None  # prepares the case directory before the run
    verify: Callable[[dict], None] | None = None  # further checks on the run_case result
    marks: tuple = field(default_factory=tuple)  # e.g. an xfail for a known bug
    env: dict = field(default_factory=dict)  # extra environment variables


def _missing_config(directory: Path) -> Path:
    return directory / "no_such_config.py"


def _syntax_error_config(directory: Path) -> Path:
    path = directory / "broken_cfg.py"
    path.write_text("epoch = 3\nbatch_size = = 16\n")
    return path


def _existing_run(directory: Path) -> None:
    """An earlier run in save_path: config, log, metrics and a committed checkpoint."""
    run = directory / "save"
    (run / "checkpoints" / "step000000010-epoch0001").mkdir(parents=True)
    (run / "checkpoints" / "step000000010-epoch0001" / "COMMITTED").write_text('{"global_step": 10}')
    (run / "checkpoints" / "step000000010-epoch0001" / "common.pth").write_bytes(os.urandom(256))
    (run / "config.py").write_text("epoch = 3\n")
    (run / "train.log").write_text("earlier run\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "epoch": 1, "train/loss": 0.5}\n')


def _config_calling_exit(directory: Path) -> Path:
    path = directory / "exits_cfg.py"
    path.write_text("import sys\nepoch = 3\nsys.exit(3)\n")
    return path


def _config_raising(directory: Path) -> Path:
    path = directory / "raises_cfg.py"
    path.write_text("epoch = 3\nraise RuntimeError('no GPU quota left')\n")
    return path


def _a_file_named_save(directory: Path) -> None:
    (directory / "save").write_text("not a directory\n")


def _model_best_only(directory: Path) -> None:
    import torch

    (directory / "save" / "model").mkdir(parents=True)
    torch.save({"state_dict": {}}, directory / "save" / "model" / "model_best.pth")


def _only_damaged_checkpoints(directory: Path) -> None:
    for step in (5, 10):
        folder = directory / "save" / "checkpoints" / f"step{step:09d}-epoch0000"
        folder.mkdir(parents=True)
        (folder / "COMMITTED").write_text('{"global_step": %d, "files": {"common.pth": {"size": 9, "crc32": 1}}}' % step)
        (folder / "common.pth").write_bytes(b"truncated")


def _other_model_weights(directory: Path) -> None:
    """A model file of a ToyMLP with another hidden width (tools/test.py must refuse it)."""
    import torch

    from tests.support.toy import ToyMLP

    torch.save({"state_dict": ToyMLP(hidden=16).state_dict()}, directory / "other.pth")


def _checkpoint_of_another_model(directory: Path) -> None:
    from pimm.engines.state.manager import CheckpointManager
    from tests.support.toy import ToyMLP

    manager = CheckpointManager(directory / "save" / "checkpoints")
    manager.register("model", ToyMLP(hidden=16))
    manager.save(5, 0)


def _left_byte_identical(result: dict) -> None:
    assert len(result["before"]) == 5 and result["after"] == result["before"]


def _left_unchanged(result: dict) -> None:
    assert result["before"] and result["after"] == result["before"]


def _code_not_run(result: dict) -> None:
    assert not (result["directory"] / "CODE_RAN").exists()


CASES = [
    Case("missing_config", ("no_such_config.py",), config=_missing_config),
    Case("config_syntax_error", ("broken_cfg.py:2",), config=_syntax_error_config),
    Case("unknown_model_type", ("ToyMLq", "'ToyMLP'"), options=("model.type=ToyMLq",)),
    Case("wrong_model_argument", ("ToyMLP", "hiden"), options=("+model.hiden=3",)),
    Case("unknown_options_key", ("optimizer.lrr", "'optimizer.lr'"), options=("optimizer.lrr=0.1",)),
    Case("malformed_option_no_equals", ("lr0.1",), options=("lr0.1",)),
    Case("malformed_option_no_key", ("'=3'",), options=("=3",)),
    Case("value_that_tries_code", ("optimizer.lr", "never run as code"),
         options=("optimizer.lr=__import__('os').system('touch CODE_RAN')",), verify=_code_not_run),
    Case("batch_not_divisible_by_processes", ("batch_size=15", "2 processes"), options=("batch_size=15",),
         num_gpus=2),
    Case("missing_weight_file", ("no_such_weights.pth",), options=("weight=no_such_weights.pth",)),
    Case("existing_save_path_without_resume", ("already holds checkpoints", "resume=True"), setup=_existing_run,
         verify=_left_byte_identical),
    Case("negative_epoch", ("epoch=-1",), options=("epoch=-1",)),
    Case("zero_batch_size", ("batch_size=0",), options=("batch_size=0",)),
    Case("negative_batch_size", ("batch_size=-8",), options=("batch_size=-8",)),
    Case("unknown_hook_type_key", ("NoSuchHook", "CheckpointSaver"), options=("hooks.NoSuchHook.x=1",)),
    Case("unknown_type_in_hooks_list", ("InformationWritter", "'InformationWriter'"),
         extra='hooks = hooks[:2] + [dict(type="InformationWritter", log_frequency=4)]\n'),
    Case("hook_bad_argument_value", ("CheckpointSaver", "save_freq", "-1"),
         options=("hooks.CheckpointSaver.save_freq=-1",)),
    Case("resume_is_a_string", ("resume='no'", "True, False"), options=("resume=no",)),
    Case("enable_amp_is_a_string", ("enable_amp='off'", "True or False"), options=("enable_amp=off",)),
    Case("evaluate_is_a_string", ("evaluate='no'", "True or False"), options=("evaluate=no",)),
    Case("num_worker_negative", ("num_worker=-1", "integer in [0, 1024]"), options=("num_worker=-1",)),
    Case("zero_processes", ("--num-gpus 0",), num_gpus=0),
    Case("missing_model", ("no `model`",), options=("model=None",)),
    Case("missing_optimizer", ("no `optimizer`",), options=("optimizer=None",)),
    Case("missing_train_data", ("data.train",), options=("data.train=None",)),
    Case("weight_is_a_directory", ("weight=", "holds no model weights"), options=("weight=.",)),
    Case("save_path_is_a_file", ("save_path=", "is a file"), setup=_a_file_named_save),
    Case("save_path_cannot_be_created", ("save",), options=("save_path=save/sub",), setup=_a_file_named_save),
    Case("config_calls_sys_exit", ("exits_cfg.py:3", "SystemExit"), config=_config_calling_exit),
    Case("config_raises", ("raises_cfg.py:2", "no GPU quota left"), config=_config_raising),
    Case("num_gpus_with_torchrun_variables", ("--num-gpus", "WORLD_SIZE"), num_gpus=2,
         env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}),
    Case("world_size_not_a_number", ("WORLD_SIZE='two'",), env={"WORLD_SIZE": "two"}),
    Case("rank_out_of_range", ("RANK=5", "WORLD_SIZE=2"),
         env={"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}),
    Case("peers_never_come", ("distributed start-up failed", "PIMM_DIST_INIT_TIMEOUT"),
         env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29998",
              "PIMM_DIST_INIT_TIMEOUT": "3"}),
    Case("evaluator_without_val_split", ("ClsEvaluator", "data.val"), options=("data.val=None",)),
    Case("empty_training_set", ("data.train (ToyDataset) is empty",), options=("data.train.num_samples=0",)),
    Case("empty_val_split_with_an_evaluator", ("data.val (ToyDataset) is empty", "ClsEvaluator"),
         options=("data.val.num_samples=0",)),
    Case("model_files_of_an_earlier_run", ("already holds model files", "resume=True"), setup=_model_best_only,
         verify=_left_unchanged),
    Case("resume_with_only_damaged_checkpoints", ("step000000010-epoch0000", "step000000005-epoch0000",
                                                  "allow_fresh"), options=("resume=True",),
         setup=_only_damaged_checkpoints),
    Case("resume_with_another_model", ("does not fit model ToyMLP", "net.0.weight"), options=("resume=True",),
         setup=_checkpoint_of_another_model),
    Case("first_forward_fails", ("ToyMLP", "first training batch", "mat1 and mat2"), options=("model.dim=4",)),
    Case("first_forward_fails_on_two_ranks", ("ToyMLP", "first training batch"), options=("model.dim=4",),
         num_gpus=2),
    Case("broken_data_sample", ("BrokenSampleDataset", "sample 5", "corrupt record at offset 640"),
         options=("data.train.type=BrokenSampleDataset",)),
    Case("broken_data_sample_in_a_worker", ("BrokenSampleDataset", "sample 5", "corrupt record"),
         options=("data.train.type=BrokenSampleDataset", "num_worker=2")),
    Case("test_tool_with_weights_that_do_not_fit", ("other.pth", "net.0.weight", "shape mismatch"), tool="test",
         options=("weight=other.pth",), setup=_other_model_weights),
    Case("parallel_unknown_strategy", ("parallel.strategy='zero3'", "'ddp' or 'fsdp'"),
         options=("parallel.strategy=zero3",)),
    Case("parallel_unknown_option", ("parallel", "'shard_policy'", "shard_modules"),
         options=("+parallel.shard_policy=1",)),
    Case("parallel_fsdp_option_under_ddp", ("parallel.reshard_after_forward", "strategy='fsdp'"),
         options=("parallel.reshard_after_forward=False",)),
    Case("parallel_bad_precision_dtype", ("parallel.mixed_precision.param_dtype='fp8'", "'bfloat16'"),
         options=("parallel.strategy=fsdp", "parallel.mixed_precision={'param_dtype': 'fp8'}")),
    Case("parallel_unknown_module_class", ("parallel.shard_modules", "'Blok'", "ToyMLP", "Linear"), num_gpus=2,
         options=("parallel.strategy=fsdp", "parallel.shard_modules=['Blok']")),
    Case("ema_under_fsdp", ("EMAHook", "fsdp"), options=("parallel.strategy=fsdp",),
         extra="hooks = hooks + [dict(type='EMAHook')]\n"),
    Case("unknown_cli_flag", ("--bogus",), argv=("--bogus",)),
    Case("test_tool_without_weight", ("weight",), tool="test"),
]


def _command(case: Case, cfg_path: Path) -> list[str]:
    cmd = [sys.executable, str(ROOT / "tools" / f"{case.tool}.py"), "--config-file", str(cfg_path)]
    if case.num_gpus is not None:
        cmd += ["--num-gpus", str(case.num_gpus)]
    cmd += list(case.argv)
    if case.options:
        cmd += ["--options", *case.options]
    return cmd


def _snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def run_case(case: Case, directory: Path, extra_env: dict | None = None) -> dict:
    extra_env = {**case.env, **(extra_env or {})}
    directory.mkdir(parents=True, exist_ok=True)
    save_path = directory / "save"
    cfg_path = case.config(directory) if case.config else write_toy_config(directory, save_path, case.extra)
    if case.setup:
        case.setup(directory)
    before = _snapshot(save_path) if save_path.exists() else {}
    # Relative paths in options (weights, the code marker) resolve inside the case directory.
    proc = forkserver.run(_command(case, cfg_path), timeout=120, env={**tool_env(), **(extra_env or {})},
                          cwd=directory)
    after = _snapshot(save_path) if save_path.exists() else {}
    return {"proc": proc, "before": before, "after": after, "directory": directory}


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> dict[str, dict]:
    """Run every selected case once, a few concurrently."""
    wanted = {item.callspec.params["case"].id for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec") and "case" in item.callspec.params}
    root = tmp_path_factory.mktemp("cli_errors")
    cases = [c for c in CASES if c.id in wanted]
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        futures = {c.id: pool.submit(run_case, c, root / c.id) for c in cases}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_bad_input_exits_2_with_one_error_line(case, results):
    result = results[case.id]
    proc = result["proc"]
    assert proc.returncode == 2, f"exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}"
    # stderr also carries the log lines written before the error (logs go to stderr, like Python's logging)
    lines = non_log_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for culprit in case.culprits:
        assert culprit in lines[0], f"{culprit!r} not named in: {lines[0]}"
    assert "Traceback" not in proc.stdout + proc.stderr
    if case.verify:
        case.verify(result)


def test_cases_cover_the_contract():
    assert len(CASES) >= 16 and len({c.id for c in CASES}) == len(CASES)


def test_pimm_debug_shows_the_traceback(tmp_path):
    case = next(c for c in CASES if c.id == "unknown_model_type")
    proc = run_case(case, tmp_path, extra_env={"PIMM_DEBUG": "1"})["proc"]
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr and "RegistryError" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("error: ") and "ToyMLq" in proc.stderr.splitlines()[-1]

