"""Upstream pimm's pre-training configs as upstream wrote them
(``tests/support/upstream_configs/``: Sonata's ``pretrain-sonata-v1m1-pilarnet-smallmask.py``
over PT-v3m2, and PoLAr-MAE's pre-training and its three semantic-segmentation
fine-tunes, ``configs/polarmae/**``) load through pimm's config loader with
only ``data_root`` pointed at generated PILArNet files and the widths shrunk
by options; every hook they list resolves, and their model, criteria,
training data and transforms, optimizer (with ``param_dicts``) and scheduler,
built as the trainer builds them, take two optimizer steps. (The other
upstream configs: tests/test_upstream_semseg_configs.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

import pimm.datasets  # noqa: F401  (registers what the configs name, as tools/train.py does)
import pimm.evaluation  # noqa: F401
import pimm.models  # noqa: F401

from pimm.datasets.lartpc import LArTPCSynthDataset
from pimm.datasets.pilarnet import write_pilarnet_h5
from pimm.utils.config import Config
from tests.support.inprocess import two_steps_in_process
from tests.support.run import ROOT

CONFIGS = ROOT / "tests" / "support" / "upstream_configs"
SMALLMASK = CONFIGS / "panda" / "pretrain" / "pretrain-sonata-v1m1-pilarnet-smallmask.py"
POLARMAE = sorted((CONFIGS / "polarmae").rglob("*.py"))
WIDTH = 8


@pytest.fixture(scope="module")
def data_roots(tmp_path_factory):
    """PILArNet-M files of generated events for each layout revision the configs name."""
    roots = {}
    for revision in ("v1", "v2"):
        root = tmp_path_factory.mktemp(f"pilarnet_{revision}")
        for split in ("train", "val", "test"):
            events = LArTPCSynthDataset(num_events=4, seed=5, split=split, points_per_event=(1100, 1400))
            (root / split).mkdir()
            write_pilarnet_h5((events[i] for i in range(4)), root / split / "events_0000.h5", revision=revision)
        roots[revision] = root
    return roots


def shrink(config: Path, roots: dict) -> list[str]:
    """``data_root`` per split and every width shrunk (upstream: 48..512 for
    PT-v3, ViT-small's 384 for PoLAr-MAE); nothing else changes."""
    cfg = Config.fromfile(config)
    options = [f"data.{s}.data_root={roots[cfg.data[s].get('revision', 'v2')]}"
               for s in ("train", "val", "test") if s in cfg.data]
    model = cfg.model
    if model["type"] == "Sonata-v1m1":
        stages, level = len(model["backbone"]["enc_channels"]), model["up_cast_level"]
        options += [f"model.backbone.enc_channels={[WIDTH] * stages}", f"model.backbone.enc_num_head={[2] * stages}",
                    f"model.head_in_channels={WIDTH * (level + 1)}", "model.head_hidden_channels=32",
                    "model.head_embed_channels=16", "model.head_num_prototypes=32"]
    else:  # PoLAr-MAE: 12 blocks (the fine-tunes read layers 3, 7, 11) of width 24
        options += ["+model.transformer_kwargs.embed_dim=24", "+model.transformer_kwargs.num_heads=2"]
        if "decoder_kwargs" in model:
            options += ["+model.decoder_kwargs.transformer_kwargs.embed_dim=24",
                        "+model.decoder_kwargs.transformer_kwargs.num_heads=2"]
        if "seg_head_dim" in model:
            options.append("model.seg_head_dim=16")
    return [o.replace(" ", "") for o in options + ["batch_size=2", "num_worker=0"]]


# Sonata's full-depth recipe (23 blocks, 6 views) takes ~45 s even shrunk: slow tier (its pieces are
# also trained in-process by test_sonata_train.py).
@pytest.mark.parametrize("config", [pytest.param(SMALLMASK, marks=pytest.mark.slow), *POLARMAE],
                         ids=lambda c: c.stem)
def test_upstream_pretraining_config_takes_two_steps(config, data_roots, tmp_path):
    from pimm.engines.run.launch import load_config

    cfg, hooks = load_config(str(config), [f"save_path={tmp_path / 'run'}", *shrink(config, data_roots)],
                             world_size=1)
    assert hooks  # every hook the file lists resolved to a registered pimm hook
    moved, frozen = two_steps_in_process(cfg)
    assert moved and not moved & frozen
    if "peft" in config.stem:  # the frozen encoder stays as it was
        assert any(n.startswith("encoder.") for n in frozen) and not any(n.startswith("encoder.") for n in moved)
