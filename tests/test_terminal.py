"""What a user sees on a terminal: ``tools/train.py`` runs on a pseudo-terminal
(stdout and stderr both on it, so the progress bar is on), the bytes it
wrote are replayed through a small terminal model (carriage returns,
cursor-up, erase-line), and every log line must own its screen line; log
lines stay within 160 characters; the console loss is the dashboards' loss
for the same window. Without a terminal, logs go to stderr and no bar is drawn.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.run import ROOT, env, write_toy_config
from tests.test_dashboards import read_tensorboard

LOG_LINE = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING|ERROR)\]")
TRAIN_LINE = re.compile(r"Train: \[\d+/\d+\]\[\d+/\d+\] step (\d+) loss ([0-9.]+)")

WIDE_HOOK = '''
import torch
from pimm.engines import HOOKS, HookBase


@HOOKS.register_module(force=True)
class ManyScalars(HookBase):
    """Forty dense train/* scalars per step, like a GRPO run's diagnostics."""

    def after_step(self):
        loss = self.trainer.comm_info["loss"].detach()
        self.trainer.metrics.publish({f"train/diagnostic_value_{i:02d}": loss * (i + 1) for i in range(40)},
                                     dense=True)
'''

HOOKS_CFG = '''
custom_imports = ["tests.support.toy", "wide_hooks"]
epoch = 2
hooks = [
    dict(type="IterationTimer", warmup_iter=1),
    dict(type="ManyScalars"),
    dict(type="InformationWriter", log_frequency=2),
    dict(type="ProgressBar"),
    dict(type="ClsEvaluator", num_classes=2),
]
'''


def render(raw: str) -> list[str]:
    """The screen lines a terminal shows after ``raw`` (no wrapping)."""
    lines: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\x1b":
            match = re.match(r"\x1b\[(\d*)([A-Za-z])", raw[i:])
            if match:
                count, code = int(match.group(1) or 1), match.group(2)
                if code == "A":
                    row = max(0, row - count)
                elif code == "K":
                    del lines[row][col:]
                i += match.end()
                continue
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append([])
        else:
            line = lines[row]
            if col < len(line):
                line[col] = ch
            else:
                line.extend(" " * (col - len(line)) + ch)
            col += 1
        i += 1
    return ["".join(line).rstrip() for line in lines]


def _config(tmp_path: Path) -> Path:
    (tmp_path / "wide_hooks.py").write_text(WIDE_HOOK)
    return write_toy_config(tmp_path, tmp_path / "run", HOOKS_CFG)


def _env(tmp_path: Path) -> dict:
    out = env()
    out["PYTHONPATH"] = os.pathsep.join([str(tmp_path), out["PYTHONPATH"]])
    out.pop("TQDM_DISABLE", None)
    return out


def run_on_a_terminal(cmd: list[str], env: dict, timeout: float = 300) -> str:
    """Run ``cmd`` with stdout and stderr on one pseudo-terminal; what it wrote."""
    master, slave = pty.openpty()
    import fcntl
    import struct
    import termios

    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))  # 200 columns
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, cwd=ROOT,
                            close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0, text[-3000:]
    return text


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_on_a_terminal_log_lines_never_share_a_line_with_the_progress_bar(tmp_path):
    cfg = _config(tmp_path)
    raw = run_on_a_terminal([sys.executable, str(ROOT / "tools" / "train.py"), "--config-file", str(cfg)],
                            _env(tmp_path))
    assert re.search(r"epoch 1/2: +\d+%\|", raw), "the progress bar was never drawn: the test would prove nothing"
    screen = render(raw)
    logged = [line for line in screen if LOG_LINE.search(line)]
    train_lines = [line for line in logged if TRAIN_LINE.search(line)]
    assert len(train_lines) >= 4 and any("Eval at step" in line for line in logged)
    for line in screen:
        found = LOG_LINE.search(line)
        if found:
            assert found.start() == 0, f"a log line shares a screen line: {line!r}"
            assert "%|" not in line and "it/s" not in line, f"progress bar remnants on a log line: {line!r}"
    for line in train_lines:  # forty extra scalars do not make a 700-character line
        assert len(line) <= 160, line
        assert re.search(r"\(\+\d+ in metrics\.jsonl\)", line), line
    assert all(len(line) <= 160 for line in logged if "Eval at step" in line)
    # the console's loss is TensorBoard's loss for the same window
    board = dict(read_tensorboard(tmp_path / "run" / "tensorboard")["train/loss"])
    for line in train_lines:
        step, loss = TRAIN_LINE.search(line).groups()
        assert f"{board[int(step)]:.4f}" == loss, (line, board)


def test_without_a_terminal_logs_go_to_stderr_and_no_bar_is_drawn(tmp_path):
    cfg = _config(tmp_path)
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "train.py"), "--config-file", str(cfg)],
                          capture_output=True, text=True, env=_env(tmp_path), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not LOG_LINE.search(done.stdout), done.stdout[-2000:]
    assert len(TRAIN_LINE.findall(done.stderr)) >= 4 and "it/s" not in done.stderr and "%|" not in done.stderr


# ----------------------------------------------------------------------------- the ETA and the line width


def test_the_eta_counts_evaluation_time(monkeypatch):
    """Steps of 1 s and a 10 s evaluation after step 4 (a fake clock): the ETA
    is the wall time per step so far, evaluation included, times the steps left."""
    from types import SimpleNamespace

    from pimm.engines.hooks import timer as timer_module
    from pimm.engines.observe.metrics import MetricChannel

    clock = [100.0]
    monkeypatch.setattr(timer_module.time, "perf_counter", lambda: clock[0])
    trainer = SimpleNamespace(metrics=MetricChannel(), max_epoch=1, epoch=0, iters_per_epoch=10, iter=0)
    hook = timer_module.IterationTimer(warmup_iter=1)
    hook.trainer = trainer
    hook.before_train()
    for step in range(1, 7):
        hook.before_step()
        clock[0] += 1.0  # the step
        trainer.iter = step
        hook.after_step()
        if step == 4:
            clock[0] += 10.0  # an evaluation between steps 4 and 5
    assert trainer.metrics.mean("time/step") == pytest.approx(1.0)  # the step alone
    # since the end of step 1: 5 steps and one evaluation took 15 s; 4 steps left
    assert trainer.metrics.latest("time/eta") == pytest.approx(15.0 / 5 * 4)


def test_fit_line_keeps_console_lines_within_the_width():
    from pimm.utils.logger import LOG_PREFIX_WIDTH, fit_line

    items = [f"metric_{i:02d} {i * 1.5:.4g}" for i in range(60)]
    line = fit_line("Eval at step 100 (3.1s):", items, "", max_width=160)
    assert len(line) + LOG_PREFIX_WIDTH <= 160 and line.endswith("in metrics.jsonl)")
    shown = line.count("metric_")
    assert f"(+{60 - shown} in metrics.jsonl)" in line and shown > 3
    assert fit_line("head", ["a 1", "b 2"], "tail") == "head a 1 b 2 tail"  # what fits is all shown
    assert fit_line("head", ["a 1", "b 2"], "tail", max_items=1) == "head a 1 (+1 in metrics.jsonl) tail"
