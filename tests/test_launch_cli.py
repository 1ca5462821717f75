"""``pimm launch`` and ``pimm ls``, upstream pimm's front door, and ``python -m
pimm.train`` / ``torchrun pimm/train.py``.

Upstream's own commands run unmodified: the first command of its README (a
dry run of ``configs/tests/tiny_semseg.py`` by name), the ``--`` tail run
training that config for real to completion, and the examples of its CLI
reference (``docs/source/reference/cli.md``) against a project laid out as
upstream's: its configs (``tests/support/upstream_configs``) and its launch
profiles (``tests/support/upstream_launch``, copied byte for byte). The site
files load and merge in upstream's order; bad flags, tail tokens and
settings are one ``error:`` line and exit 2.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pimm.cli import main as pimm_main
from tests.support.run import ROOT, env as tool_env, write_toy_config

UPSTREAM_LAUNCH = ROOT / "tests" / "support" / "upstream_launch" / "launch"
UPSTREAM_CONFIGS = ROOT / "tests" / "support" / "upstream_configs"
TINY = "tests/tiny_semseg"


def pimm(capsys, *argv: str) -> tuple[int, str, str]:
    code = pimm_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def exec_line(out: str) -> list[str]:
    """The training command of a printed launch script (its ``exec`` line)."""
    return shlex.split(out[out.index("\nexec ") + 1:])[1:]  # the script's last command (it may span lines)


def options_of(command: list[str]) -> list[str]:
    return command[command.index("--options") + 1:]


@pytest.fixture
def upstream_project(tmp_path, monkeypatch):
    """A project laid out as upstream's checkout: configs/ and launch/ (upstream's files)."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "configs").symlink_to(UPSTREAM_CONFIGS, target_is_directory=True)
    shutil.copytree(UPSTREAM_LAUNCH, root / "launch")
    monkeypatch.chdir(root)
    return root


@pytest.fixture
def in_checkout(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PIMM_LAUNCH_COMMAND", raising=False)
    return ROOT


# ----------------------------------------------------------------------------- upstream's README


def test_the_readme_first_command_resolves_the_config_by_name_and_starts_nothing(in_checkout, capsys):
    before = set((ROOT / "exp").rglob("*")) if (ROOT / "exp").exists() else set()
    code, out, err = pimm(capsys, "launch", "--train.config", TINY, "--resources.nproc-per-node", "1", "--dry-run")
    assert code == 0, err
    command = exec_line(out)
    assert command[:3] == [sys.executable, "-m", "pimm.train"]  # one process: pimm's own training entry point
    assert command[command.index("--config-file") + 1] == str(ROOT / "configs" / "tests" / "tiny_semseg.py")
    save_path = Path(options_of(command)[0].removeprefix("save_path="))
    assert save_path.parent == ROOT / "exp" / "tests" and save_path.name.startswith("tiny_semseg-20")
    assert "nothing was started" in out and "site: local" in out  # the resolved settings are printed
    after = set((ROOT / "exp").rglob("*")) if (ROOT / "exp").exists() else set()
    assert after == before  # a dry run writes nothing


def test_the_tail_is_yaml_values_under_dotted_keys(in_checkout, capsys):
    code, out, err = pimm(capsys, "launch", "--train.config", TINY, "--resources.nproc-per-node", "1",
                          "--run.name", "smoke", "--run.no-timestamp", "--dry-run", "--",
                          "epoch=1", "use_wandb=False", "data.train.max_len=32", "optimizer.betas=[0.8, 0.95]",
                          "optimizer.weight_decay=1e-2", "seed=null")
    assert code == 0, err
    options = options_of(exec_line(out))
    assert options == [f"save_path={ROOT / 'exp' / 'tests' / 'smoke'}", "epoch=1", "use_wandb=False",
                       "data.train.max_len=32", "optimizer.betas=[0.8, 0.95]", "optimizer.weight_decay=1e-2",
                       "seed=None"]


@pytest.mark.parametrize("token", ["epoch", "--epoch=2", "=3"])
def test_a_tail_token_that_is_not_key_value_is_one_line(in_checkout, capsys, token):
    code, out, err = pimm(capsys, "launch", "--train.config", TINY, "--dry-run", "--", "epoch=1", token)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and repr(token) in err, err


def test_a_misspelt_tail_key_names_the_real_one(in_checkout, capsys):
    code, _, err = pimm(capsys, "launch", "--train.config", TINY, "--resources.nproc-per-node", "1", "--dry-run",
                        "--", "epok=2")
    assert code == 2 and err.count("\n") == 1 and "epoch" in err, err


def test_a_config_name_may_carry_the_configs_prefix_and_py_suffix(in_checkout, capsys):
    for name in ("configs/tests/tiny_semseg.py", "tests/tiny_semseg.py", str(ROOT / "configs/tests/tiny_semseg.py")):
        code, out, err = pimm(capsys, "launch", "--train.config", name, "--resources.nproc-per-node", "1",
                              "--run.name", "x", "--run.no-timestamp", "--dry-run")
        assert code == 0, err
        command = exec_line(out)
        assert command[command.index("--config-file") + 1] == str(ROOT / "configs" / "tests" / "tiny_semseg.py")
        assert options_of(command)[0] == f"save_path={ROOT / 'exp' / 'tests' / 'x'}"  # the config's folder


def test_auto_processes_are_the_visible_gpus(in_checkout, capsys, monkeypatch):
    import torch

    code, out, err = pimm(capsys, "launch", "--train.config", TINY, "--dry-run")  # the local site: auto
    assert code == 0 and exec_line(out)[1:3] == ["-m", "pimm.train"], err  # no GPU here: one process
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, out, err = pimm(capsys, "launch", "--train.config", TINY, "--dry-run")
    assert code == 0 and "--nproc-per-node=2" in exec_line(out), err


def test_a_misspelt_config_name_says_did_you_mean(in_checkout, capsys):
    code, _, err = pimm(capsys, "launch", "--train.config", "tests/tiny_semsg", "--dry-run")
    assert code == 2 and err.count("\n") == 1
    assert "did you mean tests/tiny_semseg?" in err and "pimm ls tests" in err, err


@pytest.mark.parametrize("argv, culprit", [
    (["--resources.nproc-per-node", "four"], "--resources.nproc-per-node"),
    (["--resources.nnodes", "0"], "--resources.nnodes 0"),
    (["--site", "lcoal"], "did you mean 'local'?"),
    (["--recipe", "launch/runs/none.yaml"], "--recipe launch/runs/none.yaml"),
    (["--resources.gpu-directive", "gpus"], "--resources.gpu-directive"),
    (["--train.resume", "--run.name", "never-ran", "--run.no-timestamp"], "does not exist"),
])
def test_bad_launch_flags_are_one_line(in_checkout, capsys, argv, culprit):
    code, out, err = pimm(capsys, "launch", "--train.config", TINY, "--dry-run", *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and culprit in err, err


def test_without_a_config_the_line_says_how_to_name_one(in_checkout, capsys):
    code, _, err = pimm(capsys, "launch", "--dry-run")
    assert code == 2 and "--train.config NAME" in err and "pimm ls" in err


def test_secrets_are_exported_but_never_printed(in_checkout, capsys, tmp_path):
    script = tmp_path / "launch.sh"
    code, out, err = pimm(capsys, "launch", "--train.config", TINY, "--resources.nproc-per-node", "1",
                          "--run.wandb-api-key", "s3cr3t-key", "--output", str(script), "--dry-run")
    assert code == 0, err
    assert "s3cr3t-key" not in out and "s3cr3t-key" not in script.read_text()
    # the value reaches training through the environment: the script names the variable only
    assert "\nexport WANDB_API_KEY\n" in out and "wandb_api_key: <redacted>" in out
    recorded = next(l for l in out.splitlines() if l.startswith("export PIMM_LAUNCH_COMMAND="))
    assert "--run.wandb-api-key '<redacted>'" in shlex.split(recorded.split("=", 1)[1])[0]
    assert "--dry-run" not in recorded and "--output" not in recorded  # the command that runs it again


def test_several_processes_go_through_pimm_torchrun(in_checkout, capsys):
    code, out, err = pimm(capsys, "launch", "--train.config", TINY, "--resources.nproc-per-node", "2",
                          "--dry-run")
    assert code == 0, err
    command = exec_line(out)
    assert command[1:6] == ["-m", "pimm.distributed.torchrun", "--standalone", "--nproc-per-node=2",
                            "--max-restarts=0"]
    assert command[6:8] == ["--module", "pimm.train"]


def test_several_nodes_find_their_rank_and_master_from_slurm(in_checkout, capsys):
    code, out, err = pimm(capsys, "launch", "--train.config", TINY, "--resources.nproc-per-node", "2",
                          "--resources.nnodes", "2", "--dry-run")
    assert code == 0, err
    assert "--nnodes=2" in out and '"--node-rank=$NODE_RANK"' in out and '"--master-addr=$MASTER_ADDR"' in out
    script = out[out.index("#!/bin/bash"):].splitlines()
    rendezvous = [l for l in script if l.startswith(("export NODE_RANK=", "MASTER_", "export MASTER_"))]
    assert len(rendezvous) == 4, script
    shown = subprocess.run(["bash", "-c", "\n".join([*rendezvous, 'echo "$NODE_RANK $MASTER_ADDR $MASTER_PORT"'])],
                           env=dict(os.environ, SLURM_NODEID="1", SLURM_JOB_ID="4321", MASTER_ADDR="10.0.0.7"),
                           capture_output=True, text=True)
    assert shown.stdout.split() == ["1", "10.0.0.7", str(10000 + 4321 % 20000)], shown.stderr


def test_train_test_evaluates_through_pimm_test(in_checkout, capsys, tmp_path):
    config = write_toy_config(tmp_path, tmp_path / "unused")  # a config with a test split
    weight = tmp_path / "w.pth"
    weight.write_bytes(b"")
    base = ["launch", "--train.config", str(config), "--paths.repo-root", str(tmp_path),
            "--resources.nproc-per-node", "1", "--train.test", "--dry-run"]
    code, out, err = pimm(capsys, *base, "--train.weight", str(weight))
    assert code == 0, err
    command = exec_line(out)
    assert command[1:3] == ["-m", "pimm.cli.test"] and f"weight={str(weight)!r}" in options_of(command)
    code, out, err = pimm(capsys, *base)
    assert code == 2 and "weight" in err and err.count("\n") == 1, err


# ----------------------------------------------------------------------------- upstream's CLI reference


def test_the_cli_reference_examples_run_unmodified(upstream_project, capsys):
    # pimm ls panda/pretrain
    code, out, err = pimm(capsys, "ls", "panda/pretrain")
    assert code == 0 and out.split() == ["panda/pretrain/pretrain-sonata-v1m1-pilarnet-smallmask-v3m8",
                                         "panda/pretrain/pretrain-sonata-v1m1-pilarnet-smallmask"], err
    # the override boundary (it runs for real in test_the_override_boundary_example_trains)
    code, out, err = pimm(capsys, "launch", "--train.config", "tests/tiny_semseg", "--resources.nproc-per-node", "1",
                          "--run.name", "smoke", "--dry-run", "--", "epoch=1", "batch_size=4",
                          "data.train.max_len=32")
    assert code == 0, err
    options = options_of(exec_line(out))
    assert options[0].startswith(f"save_path={upstream_project / 'exp' / 'tests' / 'smoke-20'}")
    assert options[1:] == ["epoch=1", "batch_size=4", "data.train.max_len=32"]
    # pimm launch: resolve without starting training
    code, out, err = pimm(capsys, "launch", "--train.config", "panda/pretrain/pretrain-sonata-v1m1-pilarnet-smallmask",
                          "--resources.nproc-per-node", "4", "--dry-run")
    assert code == 0, err
    assert "--nproc-per-node=4" in exec_line(out)
    # exit-before-spend checks
    code, out, err = pimm(capsys, "launch", "--train.config", "panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-fft",
                          "--dry-run")
    assert code == 0, err
    for command in ("launch", "submit", "watchdog", "ls"):
        with pytest.raises(SystemExit) as done:
            pimm_main([command, "--help"])
        assert done.value.code == 0
        assert f"usage: pimm {command}" in capsys.readouterr().out


def test_batch_sizes_are_checked_at_the_launch_world_size(upstream_project, capsys):
    code, out, err = pimm(capsys, "launch", "--train.config", "tests/tiny_semseg", "--resources.nproc-per-node", "1",
                          "--resources.nnodes", "2", "--dry-run", "--", "epoch=1", "batch_size=3")
    assert code == 2 and "batch_size" in err and err.count("\n") == 1, err  # 3 over 2 processes


# ----------------------------------------------------------------------------- site and recipe files


UPSTREAM_SITES = ["local", "slurm", "s3df", "s3df-container", "nersc", "nersc-container", "gcloud"]


@pytest.mark.parametrize("site", UPSTREAM_SITES)
def test_upstreams_site_files_load_unmodified(upstream_project, site):
    from pimm.cli.launch import resolve_argv

    cfg = resolve_argv(["--site", site, "--train.config", TINY], "launch").config
    assert cfg.site == site
    expected = {
        "local": dict(scheduler="local", nproc="auto", runtime="none", cpus=8),
        "slurm": dict(scheduler="slurm", nproc=4, runtime="none", cpus=12),
        "s3df": dict(scheduler="slurm", nproc=1, runtime="none", cpus=12),
        "s3df-container": dict(scheduler="slurm", nproc=1, runtime="singularity", cpus=12),
        "nersc": dict(scheduler="slurm", nproc=4, runtime="none", cpus=6),
        "nersc-container": dict(scheduler="slurm", nproc=4, runtime="shifter", cpus=6),
        "gcloud": dict(scheduler="gcloud", nproc=1, runtime="none", cpus=12),
    }[site]
    assert (cfg.resources.scheduler, cfg.resources.nproc_per_node, cfg.container.runtime,
            cfg.resources.cpus_per_proc) == tuple(expected.values())
    if site == "nersc-container":  # _base_: slurm.yaml under it, the site's own keys on top
        assert cfg.resources.time == "24:00:00" and cfg.resources.gpu_directive == "gpus-per-node"
        assert cfg.container.unset_env == ["LD_LIBRARY_PATH", "LD_PRELOAD"]
        assert cfg.setup == ["export LD_LIBRARY_PATH=/opt/hdf5/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"]
        assert cfg.env["NCCL_SOCKET_IFNAME"] == "^docker0,lo"
    if site == "s3df":
        assert cfg.paths.exp_root == "/sdf/data/neutrino/gregork/pimm_exp" and cfg.train.python == ".venv/bin/python"
    if site == "local":  # {repo_root} expanded
        assert cfg.paths.exp_root == "./exp"


def test_merge_order_is_defaults_site_recipe_flags(upstream_project):
    from pimm.cli.launch import resolve_argv

    resolved = resolve_argv(["--site", "s3df", "--recipe", "launch/runs/e050_tail.yaml", "--train.config", TINY,
                             "--resources.mem", "32G", "--", "epoch=3"], "submit")
    cfg = resolved.config
    assert cfg.resources.time == "72:00:00"  # the recipe over defaults.yaml and the site
    assert cfg.resources.partition == "ampere" and cfg.resources.account == "mli:nu-ml-dev"  # the site
    assert cfg.resources.mem == "32G"  # the flag over the site
    assert cfg.train.config == TINY  # the flag over the recipe
    assert cfg.resources.output == "slurm_logs/slurm-%j.out"  # defaults.yaml
    assert cfg.train.weight.startswith("/sdf/data/neutrino/gregork/pimm_exp/panda/pretrain_geometry_combos/E047")
    assert cfg.run.name.startswith("E050-Head512TailWD20")
    # the recipe's options in order, then the tail (which wins)
    assert resolved.options[:3] == ["data.train.max_len=100000", "epoch=100", "batch_size=48"]
    assert resolved.options[-1] == "epoch=3" and "optimizer.lr=3e-5" in resolved.options
    assert [Path(p).name for p in resolved.layers] == ["defaults.yaml", "s3df.yaml", "e050_tail.yaml"]


def test_the_packaged_sites_work_without_a_project_launch_folder(tmp_path, monkeypatch):
    from pimm.cli.launch import resolve_argv

    (tmp_path / "configs").mkdir()
    monkeypatch.chdir(tmp_path)
    for site in ("local", "slurm"):
        resolved = resolve_argv(["--site", site, "--train.config", "x"], "launch")
        assert Path(resolved.layers[1]) == ROOT / "pimm" / "launch" / "sites" / f"{site}.yaml"
        assert Path(resolved.layers[0]) == ROOT / "pimm" / "launch" / "defaults.yaml"


@pytest.mark.parametrize("text, culprit", [
    ("resources:\n  nproc_per_nod: 2\n", "resources.nproc_per_nod in"),
    ("resources:\n  nnodes: two\n", "resources.nnodes: 'two' is invalid"),
    ("runn:\n  name: x\n", "did you mean 'run'?"),
    ("env: [1, 2]\n", "env: [1, 2] is invalid"),
    ("paths:\n  exp_root: '{nowhere}/exp'\n", "unknown placeholder {nowhere}"),
    ("resources: [\n", "is not valid YAML"),
    ("_base_: missing.yaml\n", "cannot read"),
])
def test_a_bad_site_file_is_one_line_naming_the_setting(tmp_path, monkeypatch, capsys, text, culprit):
    (tmp_path / "configs" / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "configs" / "tests" / "tiny_semseg.py", tmp_path / "configs" / "tests")
    (tmp_path / "launch" / "sites").mkdir(parents=True)
    (tmp_path / "launch" / "sites" / "mine.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    code, out, err = pimm(capsys, "launch", "--site", "mine", "--train.config", TINY, "--dry-run")
    assert code == 2 and err.count("\n") == 1 and culprit in err, err


def test_upstreams_older_slurm_group_is_read_as_resources(tmp_path, monkeypatch):
    from pimm.cli.launch import resolve_argv

    (tmp_path / "launch" / "sites").mkdir(parents=True)
    (tmp_path / "launch" / "sites" / "old.yaml").write_text(
        "slurm:\n  account: lab\n  time: '02:00:00'\n  image: img.sif\n  additional_parameters:\n    exclusive: true\n")
    monkeypatch.chdir(tmp_path)
    cfg = resolve_argv(["--site", "old"], "submit").config
    assert (cfg.resources.scheduler, cfg.resources.account, cfg.resources.time) == ("slurm", "lab", "02:00:00")
    assert cfg.resources.scheduler_options == {"exclusive": True} and cfg.container.image == "img.sif"


# ----------------------------------------------------------------------------- containers


def test_containers_wrap_the_command_as_upstreams_launcher(in_checkout, capsys):
    base = ["launch", "--train.config", TINY, "--resources.nproc-per-node", "1", "--dry-run"]
    code, out, err = pimm(capsys, *base, "--container.runtime", "apptainer", "--container.image", "/img/pimm.sif",
                          "--container.binds", "/data", "--container.interpreter", "/opt/venv/bin/python",
                          "--setup", "module load cuda")
    assert code == 0, err
    words = exec_line(out)
    assert words[:5] == ["apptainer", "run", "--nv", "-B", f"/data,{ROOT},{ROOT}:/opt/pimm/src"]
    assert words[5:10] == ["/img/pimm.sif", "bash", "--noprofile", "--norc", "-c"]
    inner = words[10].splitlines()
    assert inner[0] == "module load cuda" and shlex.split(inner[1])[:4] == ["exec", "/opt/venv/bin/python", "-m",
                                                                              "pimm.train"]
    code, out, err = pimm(capsys, *base, "--container.runtime", "docker", "--container.image", "pimm:dev",
                          "--container.repo-mount", "None")
    assert code == 0, err
    words = exec_line(out)
    assert words[:8] == ["docker", "run", "--rm", "--gpus", "all", "--ipc=host", "-w", str(ROOT)]
    assert ["-v", f"{ROOT}:{ROOT}"] == words[8:10] and "-e" in words and "PIMM_LAUNCH_COMMAND" in words
    code, _, err = pimm(capsys, *base, "--container.runtime", "shifter")
    assert code == 2 and "--container.image" in err


@pytest.mark.slow
def test_a_container_run_trains_inside_the_wrapper(tmp_path, monkeypatch):
    """A stand-in ``apptainer`` (it drops its own options and runs the rest, as
    the image would) on PATH: the wrapped launch trains to completion."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text('#!/bin/bash\n# apptainer run --nv -B BINDS IMAGE CMD...\n'
                                       'echo "$@" > "$FAKE_APPTAINER_LOG"\nshift 5\nexec "$@"\n')
    (bin_dir / "apptainer").chmod(0o755)
    config = write_toy_config(tmp_path, tmp_path / "unused", "epoch = 1\n")
    env = tool_env()
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_APPTAINER_LOG=str(tmp_path / "apptainer.log"))
    done = subprocess.run([sys.executable, "-m", "pimm.cli", "launch", "--train.config", str(config),
                           "--paths.repo-root", str(tmp_path), "--resources.nproc-per-node", "1",
                           "--container.runtime", "apptainer", "--container.image", "img.sif",
                           "--container.interpreter", sys.executable, "--run.name", "boxed", "--run.no-timestamp"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "apptainer.log").read_text().startswith("run --nv -B")
    assert (tmp_path / "exp" / "boxed" / "model" / "model_last.pth").is_file()


# ----------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def pilarnet_project(tmp_path_factory):
    """A project with pimm's configs/tests + _base_ and small PILArNet files for tiny_semseg."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "configs" / "tests", root / "configs" / "tests")
    shutil.copytree(ROOT / "configs" / "_base_", root / "configs" / "_base_")
    data = root / "pilarnet"
    for split in ("train", "val"):
        done = subprocess.run([sys.executable, str(ROOT / "tools" / "export_pilarnet.py"), "--out", str(data),
                               "--num-events", "8", "--seed", "3", "--split", split, "--events-per-file", "4"],
                              capture_output=True, text=True, timeout=300, env=tool_env())
        assert done.returncode == 0, done.stderr
    return root, data


def _launch(root: Path, data: Path, *argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = tool_env()
    env["PILARNET_DATA_ROOT_V2"] = str(data)  # tiny_semseg's data_root None reads it, as upstream's
    env.pop("PIMM_LAUNCH_COMMAND", None)
    return subprocess.Popen([sys.executable, "-m", "pimm.cli", "launch", *argv], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(run: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


@pytest.mark.slow
def test_the_readme_tail_run_trains_to_completion_and_resumes(pilarnet_project):
    root, data = pilarnet_project
    argv = ["--train.config", "tests/tiny_semseg", "--resources.nproc-per-node", "1", "--", "epoch=2",
            "batch_size=4", "use_wandb=False"]
    proc = _launch(root, data, *argv)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    (run,) = (root / "exp" / "tests").iterdir()
    assert run.name.startswith("tiny_semseg-20")
    losses = [r["train/loss"] for r in _records(run, "metrics.jsonl") if "train/loss" in r]
    assert len(losses) == 4  # 8 events, batch 4, 2 epochs
    (start,) = [r for r in _records(run, "attempts.jsonl") if r["event"] == "start"]
    assert start["pid"] == proc.pid  # the launch became the training process: signals reach it directly
    metadata = json.loads((run / "run_metadata.json").read_text())
    assert metadata["launch_command"] == shlex.join(["pimm", "launch", *argv])
    assert (run / "model" / "model_last.pth").is_file()

    # Continue the same run exactly: its folder by name, resume, a longer horizon.
    proc = _launch(root, data, "--train.config", "tests/tiny_semseg", "--resources.nproc-per-node", "1",
                   "--run.name", run.name, "--run.no-timestamp", "--train.resume", "--", "epoch=3")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    steps = [r["step"] for r in _records(run, "metrics.jsonl") if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # resumed at step 4, no step repeated
    assert len([r for r in _records(run, "attempts.jsonl") if r["event"] == "start"]) == 2


@pytest.mark.slow
def test_the_override_boundary_example_trains(pilarnet_project, tmp_path):
    """The first example of upstream's CLI reference, as written, in a project laid
    out as upstream's (its configs and launch profiles)."""
    _, data = pilarnet_project
    root = tmp_path / "project"
    root.mkdir()
    (root / "configs").symlink_to(UPSTREAM_CONFIGS, target_is_directory=True)
    shutil.copytree(UPSTREAM_LAUNCH, root / "launch")
    proc = _launch(root, data, "--train.config", "tests/tiny_semseg", "--resources.nproc-per-node", "1",
                   "--run.name", "smoke", "--", "epoch=1", "batch_size=4", "data.train.max_len=32")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    (run,) = (root / "exp" / "tests").iterdir()
    assert run.name.startswith("smoke-20") and (run / "model" / "model_last.pth").is_file()
    assert len([r for r in _records(run, "metrics.jsonl") if "train/loss" in r]) == 2  # 8 events, batch 4


@pytest.mark.slow
def test_two_processes_run_through_pimm_torchrun(pilarnet_project):
    root, data = pilarnet_project
    proc = _launch(root, data, "--train.config", "tests/tiny_semseg", "--resources.nproc-per-node", "2",
                   "--run.name", "pair", "--run.no-timestamp", "--", "epoch=1")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    (start,) = [r for r in _records(root / "exp" / "tests" / "pair", "attempts.jsonl") if r["event"] == "start"]
    assert start["world_size"] == 2


# ----------------------------------------------------------------------------- python -m pimm.train


@pytest.mark.slow
def test_python_m_pimm_train_and_torchrun_pimm_train_py(tmp_path):
    config = write_toy_config(tmp_path, tmp_path / "unused", "epoch = 1\n")
    done = subprocess.run([sys.executable, "-m", "pimm.train", "--config-file", str(config), "--options",
                           f"save_path={tmp_path / 'one'}"], cwd=tmp_path, env=tool_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "one" / "model" / "model_last.pth").is_file()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(ROOT / "pimm" / "train.py"), "--config-file", str(config), "--options",
                           f"save_path={tmp_path / 'two'}"], cwd=tmp_path, env=tool_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (start,) = [r for r in _records(tmp_path / "two", "attempts.jsonl") if r["event"] == "start"]
    assert start["world_size"] == 2
    # bad input through the script: the launcher's one line, exit 2
    done = subprocess.run([sys.executable, str(ROOT / "pimm" / "train.py"), "--config-file", str(config),
                           "--options", "epok=1"], cwd=tmp_path, env=tool_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 2 and "epoch" in done.stderr, done.stderr[-2000:]


def test_pimm_help_lists_the_new_commands(capsys):
    assert pimm_main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("launch", "ls", "watchdog", "submit"):
        assert f"\n  {command} " in out


def test_pimm_ls_lists_configs_by_name(in_checkout, capsys):
    code, out, err = pimm(capsys, "ls", "tests")
    assert code == 0 and out.split() == ["tests/tiny_semseg"], err
    code, out, _ = pimm(capsys, "ls")
    names = out.split()
    assert "tests/tiny_semseg" in names and "lartpc/semseg-ptv3" in names
    assert not any("_base_" in n or Path(n).name.startswith("_") for n in names)
    code, out, err = pimm(capsys, "ls", "nope")
    assert code == 2 and "no config folder 'nope'" in err and "tests" in err
    code, out, err = pimm(capsys, "ls", "../..")
    assert code == 2 and err.count("\n") == 1
