"""One command that checks pimm's GPU paths and prints one table.

    python bench/gpu_check.py [--quick]

Rows (each prints ``ok``/``FAIL``/``skipped`` and its figures):

* ``step-mlp`` / ``step-ring``: ms per training step through the engine
  against a hand-written loop (same model, batch, optimizer), both timed with
  CUDA events after a warm-up;
* ``amp-bf16`` / ``amp-fp16``: the toy task trained through ``tools/train.py``
  with ``enable_amp=True`` in bfloat16 and in float16 (GradScaler); ok when
  the loss falls;
* ``resume-cuda``: SIGKILL at step 17 and ``resume=True`` under
  ``deterministic=True``; ok when ``model_last.pth`` is bit-identical to an
  uninterrupted run's;
* ``fsdp2-1gpu``: the toy model sharded with FSDP2 (``fully_shard``) on a
  one-process NCCL group with bf16 parameters / fp32 reduction; ok when it
  learns;
* ``sparse-unet``: the sparse U-Net step (reference vs current) time and
  peak memory (``max_memory_allocated`` on a GPU; on a CPU the profiler's
  tensor-memory peak, as ``bench/sparse_unet.py``). Runs on a CPU too;
* ``sync-debug``: the trainings of ``tests/test_no_host_sync.py``
  (DefaultTrainer, InsegTrainer, GRPOTrainer, 100 steps each, default hooks
  plus an evaluator and checkpoints) under ``torch.cuda.set_sync_debug_mode
  ("error")`` for the whole of ``train()``, except inside the moments the
  engine marks as syncing by design (:mod:`pimm.engines.loop.sync_points`: metric
  flush, evaluation, checkpoint, GRPO rollout).

Without a GPU every CUDA row is skipped with its reason and the script still
runs end to end (exit 0); a failed row makes the exit status 1. Under 5
minutes on one GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

TOY = '''
_base_ = {base!r}
custom_imports = ["tests.support.toy"]
save_path = {save!r}
seed = 0
epoch = 3
batch_size = 16
model = dict(type="ToyMLP", dropout=0.1)
data = dict(train=dict(type="ToyDataset", num_samples=160, noise_aug=0.1), val=dict(type="ToyDataset", num_samples=64, seed=1))
optimizer = dict(type="AdamW", lr=0.01)
hooks = [
    dict(type="CheckpointLoader"),
    dict(type="InformationWriter", log_frequency=4),
    dict(type="CheckpointSaver", save_freq=5, keep_last=2, async_write=False),
    dict(type="KillAtStep", step=10**9, signal_name="SIGKILL"),
]
'''

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"


class Skip(Exception):
    """A row that cannot run here; its message is the one-line reason."""


def need_cuda() -> None:
    if not torch.cuda.is_available():
        raise Skip(NO_CUDA)


def toy_config(workdir: Path, name: str) -> Path:
    path = workdir / f"{name}_cfg.py"
    path.write_text(TOY.format(base=str(ROOT / "configs" / "_base_" / "default_runtime.py"),
                               save=str(workdir / name)))
    return path


def train_cli(config: Path, *options: str, expect: int = 0) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(ROOT / "tools" / "train.py"), "--config-file", str(config), "--options", *options]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if proc.returncode != expect:
        raise RuntimeError(f"tools/train.py {' '.join(options)} exited {proc.returncode}: {proc.stderr[-500:]}")


def losses(save: Path) -> list[float]:
    return [r["train/loss"] for r in map(json.loads, open(save / "metrics.jsonl")) if "train/loss" in r]


def build_in_process(config: Path, options: list[str], extra_hooks=()):
    import pimm.datasets  # noqa: F401  (registers what configs name)
    import pimm.evaluation  # noqa: F401
    import pimm.models  # noqa: F401
    from pimm.engines.run.launch import build_trainer, load_config
    from pimm.utils.logger import setup_logger

    cfg, hooks = load_config(str(config), options, world_size=1)
    logger = setup_logger(cfg.save_path, rank=0)
    for handler in list(logger.handlers):
        if not isinstance(handler, logging.FileHandler):
            logger.removeHandler(handler)
    return build_trainer(cfg, hooks=[*hooks, *extra_hooks])


def event_clock():
    """A hook timing every training step with CUDA events (read once at the end)."""
    from pimm.engines.hooks import HookBase

    class EventClock(HookBase):
        priority = "VERY_HIGH"

        def __init__(self):
            self.pairs = []

        def before_step(self):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.pairs.append([start, None])

        def after_step(self):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pairs[-1][1] = end

        def ms(self, skip: int) -> float:
            torch.cuda.synchronize()
            return statistics.median(s.elapsed_time(e) for s, e in self.pairs[skip:])

    return EventClock()


def hand_loop_ms(model, batches, lr, steps: int, skip: int) -> float:
    """A plain loop: forward, loss, backward, AdamW step, CUDA events around each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    times = []
    for i in range(steps):
        batch = {k: v.cuda(non_blocking=True) if isinstance(v, torch.Tensor) else v
                 for k, v in batches[i % len(batches)].items()}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = model(batch)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times[skip:])


def row_step(workdir: Path, which: str) -> str:
    need_cuda()
    if which == "mlp":
        config, options = toy_config(workdir, "step-mlp"), ["epoch=2", "evaluate=False"]
    else:
        config, options = ROOT / "configs" / "rings" / "cls-cnn.py", [
            f"save_path={str(workdir / 'step-ring')!r}", "epoch=1", "evaluate=False",
            "data.train.num_events=1280"]
    clock = event_clock()
    trainer = build_in_process(config, options, [clock])
    trainer.train()
    pimm_ms = clock.ms(skip=5)
    model = type(trainer.model_without_ddp)(**{k: v for k, v in trainer.cfg.model.items() if k != "type"}).cuda()
    loader = trainer.build_train_loader()
    batches = [b for _, b in zip(range(20), loader)]
    hand_ms = hand_loop_ms(model.train(), batches, trainer.cfg.optimizer.lr, steps=60, skip=5)
    return f"ok      pimm {pimm_ms:7.3f} ms/step, hand loop {hand_ms:7.3f} ms/step ({pimm_ms / hand_ms - 1:+.1%})"


def row_amp(workdir: Path, dtype: str) -> str:
    need_cuda()
    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise Skip("this GPU has no bfloat16")
    name = f"amp-{dtype}"
    train_cli(toy_config(workdir, name), "enable_amp=True", f"amp_dtype={dtype!r}")
    values = losses(workdir / name)
    first, last = statistics.mean(values[:2]), statistics.mean(values[-2:])
    ok = last < 0.8 * first
    return f"{'ok' if ok else 'FAIL':7s} loss {first:.3f} -> {last:.3f} over {len(values)} logged steps"


def row_resume(workdir: Path) -> str:
    need_cuda()
    opts = ["deterministic=True", "resume=True"]
    ref, run = toy_config(workdir, "resume-ref"), toy_config(workdir, "resume-run")
    train_cli(ref, *opts)
    train_cli(run, *opts, "hooks.KillAtStep.step=17", expect=-9)
    train_cli(run, *opts)
    a = torch.load(workdir / "resume-ref" / "model" / "model_last.pth", weights_only=True)["state_dict"]
    b = torch.load(workdir / "resume-run" / "model" / "model_last.pth", weights_only=True)["state_dict"]
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    return ("ok      SIGKILL at step 17, resume: model_last.pth bit-identical" if not differing
            else f"FAIL    resumed weights differ in {differing}")


def row_fsdp(workdir: Path) -> str:
    need_cuda()
    import torch.distributed as dist

    from pimm.engines.run.parallel import ParallelConfig, shard_model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2)).cuda()
        config = ParallelConfig(strategy="fsdp", param_dtype="bfloat16", reduce_dtype="float32")
        model = shard_model(model, config, torch.device("cuda"), 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        w = torch.randn(64, device="cuda")
        seen = []
        for _ in range(200):
            x = torch.randn(128, 64, device="cuda")
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.float(), (x @ w > 0).long())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen.append(loss.detach())
        first, last = torch.stack(seen[:10]).mean().item(), torch.stack(seen[-10:]).mean().item()
        ok = logits.dtype == torch.bfloat16 and last < 0.5 * first
        return f"{'ok' if ok else 'FAIL':7s} bf16 compute ({logits.dtype}), loss {first:.3f} -> {last:.3f}"
    finally:
        dist.destroy_process_group()


def row_sparse(quick: bool) -> str:
    import copy

    import sparse_unet as bench_sparse

    import pimm.datasets  # noqa: F401
    from pimm.engines.registries import MODELS
    from pimm.utils.config import Config

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = Config.fromfile(bench_sparse.CONFIG)
    batches = bench_sparse.make_batches(cfg, 2, 2 if quick else 4)
    batches = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]
    torch.manual_seed(0)
    reference = bench_sparse.ReferenceSparseUNet(in_channels=1)
    current = MODELS.build(dict(type="SparseUNet", in_channels=1))
    current.load_state_dict(copy.deepcopy(reference.state_dict()))
    parts = []
    peaks = {}
    for name, net in (("reference", reference), ("current", current)):
        trainee = bench_sparse.Trainee(name, net.to(device), 1e-3, 0.01)
        trainee.head.to(device)
        for b in batches:  # warm-up: optimizer state, allocator
            trainee.step(b)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            rounds = 5
            for _ in range(rounds):
                for b in batches:
                    trainee.step(b)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / (rounds * len(batches))
            peak = torch.cuda.max_memory_allocated() - base
        else:
            t = time.process_time()
            for b in batches:
                trainee.step(b)
            ms = 1e3 * (time.process_time() - t) / len(batches)
            peak = bench_sparse.peak_tensor_memory(trainee, batches[0])
        peaks[name] = peak
        parts.append(f"{name} {ms:.1f} ms {peak / 2**20:.1f} MiB")
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    return f"ok      {where}: " + ", ".join(parts) + f" (memory_ratio {peaks['current'] / peaks['reference']:.2f})"


def row_sync_debug(workdir: Path) -> str:
    """The trainings of ``tests/test_no_host_sync.py`` (DefaultTrainer, InsegTrainer,
    GRPOTrainer, 100 steps each) under ``set_sync_debug_mode("error")`` from the
    start of ``train()`` to its end, switched to "default" exactly inside the
    moments the engine marks (metric flush, evaluation, checkpoint, rollout)."""
    need_cuda()
    from pimm.engines import sync_points
    from tests.support.sync_runs import grpo_trainer, inseg_trainer, toy_trainer

    def switch(inside: bool) -> None:
        torch.cuda.set_sync_debug_mode("default" if inside else "error")

    done = []
    for name, build in (("DefaultTrainer", toy_trainer), ("InsegTrainer", inseg_trainer),
                        ("GRPOTrainer", grpo_trainer)):
        folder = workdir / f"sync-{name}"
        folder.mkdir()
        trainer = build(folder)
        try:
            with sync_points.on_moments(switch):
                torch.cuda.set_sync_debug_mode("error")
                trainer.train()
        except RuntimeError as err:
            raise RuntimeError(f"{name}: {err}") from err
        finally:
            torch.cuda.set_sync_debug_mode("default")
        done.append(f"{name} {trainer.global_step}")
    return "ok      no host sync outside flush/eval/checkpoint/rollout under sync_debug_mode('error'): " + \
        ", ".join(done) + " steps"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sparse U-Net batches (the CPU test uses it)")
    args = parser.parse_args(argv)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU only)"
    print(f"pimm GPU check: torch {torch.__version__}, GPU: {device}")
    failed = False
    with tempfile.TemporaryDirectory(prefix="pimm-gpu-check-") as tmp:
        workdir = Path(tmp)
        rows = [
            ("step-mlp", lambda: row_step(workdir, "mlp")),
            ("step-ring", lambda: row_step(workdir, "ring")),
            ("amp-bf16", lambda: row_amp(workdir, "bfloat16")),
            ("amp-fp16", lambda: row_amp(workdir, "float16")),
            ("resume-cuda", lambda: row_resume(workdir)),
            ("fsdp2-1gpu", lambda: row_fsdp(workdir)),
            ("sparse-unet", lambda: row_sparse(args.quick)),
            ("sync-debug", lambda: row_sync_debug(workdir)),
        ]
        print(f"{'check':12s} {'result':7s} details")
        for name, fn in rows:
            start = time.perf_counter()
            try:
                text = fn()
            except Skip as reason:
                text = f"skipped {reason}"
            except Exception as err:  # a row's failure is reported, the others still run
                first = str(err).splitlines()[0] if str(err) else ""
                text = f"FAIL    {type(err).__name__}: {first[:200]}"
                traceback.print_exc(file=sys.stderr)
            failed |= text.startswith("FAIL")
            print(f"{name:12s} {text}  [{time.perf_counter() - start:.0f}s]", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
