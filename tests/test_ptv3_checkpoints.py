"""Upstream PT-v3 state dicts load strictly into pimm's PT-v3.

The fixtures are upstream's parameter names and shapes, written out from
upstream pimm's source (``pimm/models/point_transformer_v3/*.py``,
``pimm/models/default.py``): the module tree (``PointSequential`` children
named ``"0"``, ``"1"``, ... or ``conv``/``linear``/``norm``/``act``), and
spconv's ``SubMConv3d`` weight in its KRSC layout ``(C_out, k, k, k, C_in)``.
The tiny one is the model of upstream's ``configs/tests/tiny_semseg.py``,
listed key by key; the full ones (the default PT-v3m1 / PT-v3m2) follow the
same rules stage by stage.
"""

from __future__ import annotations

import pytest
import torch

import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.hooks.checkpoint import CheckpointLoader
from pimm.engines.registries import MODELS
from pimm.engines.state.weights import load_weights
from pimm.utils.errors import CheckpointError

# DefaultSegmentorV2(num_classes=5, backbone_out_channels=8, backbone=PT-v3m2(in_channels=4,
# enc_channels=(8, 16), dec_channels=(8,), mlp_ratio=2, ...)) of upstream's tiny_semseg.py.
TINY_UPSTREAM = """
seg_head.weight 5,8
seg_head.bias 5
backbone.embedding.stem.linear.weight 8,4
backbone.embedding.stem.linear.bias 8
backbone.embedding.stem.norm.weight 8
backbone.embedding.stem.norm.bias 8
backbone.enc.enc0.block0.cpe.0.weight 8,3,3,3,8
backbone.enc.enc0.block0.cpe.0.bias 8
backbone.enc.enc0.block0.cpe.1.weight 8,8
backbone.enc.enc0.block0.cpe.1.bias 8
backbone.enc.enc0.block0.cpe.2.weight 8
backbone.enc.enc0.block0.cpe.2.bias 8
backbone.enc.enc0.block0.norm1.0.weight 8
backbone.enc.enc0.block0.norm1.0.bias 8
backbone.enc.enc0.block0.attn.qkv.weight 24,8
backbone.enc.enc0.block0.attn.qkv.bias 24
backbone.enc.enc0.block0.attn.proj.weight 8,8
backbone.enc.enc0.block0.attn.proj.bias 8
backbone.enc.enc0.block0.norm2.0.weight 8
backbone.enc.enc0.block0.norm2.0.bias 8
backbone.enc.enc0.block0.mlp.0.fc1.weight 16,8
backbone.enc.enc0.block0.mlp.0.fc1.bias 16
backbone.enc.enc0.block0.mlp.0.fc2.weight 8,16
backbone.enc.enc0.block0.mlp.0.fc2.bias 8
backbone.enc.enc1.down.proj.weight 16,8
backbone.enc.enc1.down.proj.bias 16
backbone.enc.enc1.down.norm.0.weight 16
backbone.enc.enc1.down.norm.0.bias 16
backbone.enc.enc1.block0.cpe.0.weight 16,3,3,3,16
backbone.enc.enc1.block0.cpe.0.bias 16
backbone.enc.enc1.block0.cpe.1.weight 16,16
backbone.enc.enc1.block0.cpe.1.bias 16
backbone.enc.enc1.block0.cpe.2.weight 16
backbone.enc.enc1.block0.cpe.2.bias 16
backbone.enc.enc1.block0.norm1.0.weight 16
backbone.enc.enc1.block0.norm1.0.bias 16
backbone.enc.enc1.block0.attn.qkv.weight 48,16
backbone.enc.enc1.block0.attn.qkv.bias 48
backbone.enc.enc1.block0.attn.proj.weight 16,16
backbone.enc.enc1.block0.attn.proj.bias 16
backbone.enc.enc1.block0.norm2.0.weight 16
backbone.enc.enc1.block0.norm2.0.bias 16
backbone.enc.enc1.block0.mlp.0.fc1.weight 32,16
backbone.enc.enc1.block0.mlp.0.fc1.bias 32
backbone.enc.enc1.block0.mlp.0.fc2.weight 16,32
backbone.enc.enc1.block0.mlp.0.fc2.bias 16
backbone.dec.dec0.up.proj.0.weight 8,16
backbone.dec.dec0.up.proj.0.bias 8
backbone.dec.dec0.up.proj.1.weight 8
backbone.dec.dec0.up.proj.1.bias 8
backbone.dec.dec0.up.proj_skip.0.weight 8,8
backbone.dec.dec0.up.proj_skip.0.bias 8
backbone.dec.dec0.up.proj_skip.1.weight 8
backbone.dec.dec0.up.proj_skip.1.bias 8
backbone.dec.dec0.block0.cpe.0.weight 8,3,3,3,8
backbone.dec.dec0.block0.cpe.0.bias 8
backbone.dec.dec0.block0.cpe.1.weight 8,8
backbone.dec.dec0.block0.cpe.1.bias 8
backbone.dec.dec0.block0.cpe.2.weight 8
backbone.dec.dec0.block0.cpe.2.bias 8
backbone.dec.dec0.block0.norm1.0.weight 8
backbone.dec.dec0.block0.norm1.0.bias 8
backbone.dec.dec0.block0.attn.qkv.weight 24,8
backbone.dec.dec0.block0.attn.qkv.bias 24
backbone.dec.dec0.block0.attn.proj.weight 8,8
backbone.dec.dec0.block0.attn.proj.bias 8
backbone.dec.dec0.block0.norm2.0.weight 8
backbone.dec.dec0.block0.norm2.0.bias 8
backbone.dec.dec0.block0.mlp.0.fc1.weight 16,8
backbone.dec.dec0.block0.mlp.0.fc1.bias 16
backbone.dec.dec0.block0.mlp.0.fc2.weight 8,16
backbone.dec.dec0.block0.mlp.0.fc2.bias 8
"""

TINY_MODEL = dict(
    type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=8,
    backbone=dict(type="PT-v3m2", in_channels=4, order=("z",), stride=(2,), enc_depths=(1, 1), enc_channels=(8, 16),
                  enc_num_head=(1, 2), enc_patch_size=(32, 32), dec_depths=(1,), dec_channels=(8,),
                  dec_num_head=(1,), dec_patch_size=(32,), mlp_ratio=2, drop_path=0.0, shuffle_orders=False,
                  enable_rpe=False, enable_flash=False, enable_cpe=True, upcast_attention=True, upcast_softmax=True,
                  enc_mode=False),
)


def parse(listing: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for line in listing.strip().splitlines():
        name, shape = line.split()
        out[name] = tuple(int(s) for s in shape.split(","))
    return out


def upstream_block(prefix: str, c: int, mlp_ratio: int = 4, rpe_rows: int = 0, heads: int = 0) -> dict:
    """One upstream ``Block``: cpe (SubMConv3d, Linear, LayerNorm), norm1, attn, norm2, mlp."""
    hidden = c * mlp_ratio
    names = {"cpe.0.weight": (c, 3, 3, 3, c), "cpe.0.bias": (c,), "cpe.1.weight": (c, c), "cpe.1.bias": (c,),
             "cpe.2.weight": (c,), "cpe.2.bias": (c,), "norm1.0.weight": (c,), "norm1.0.bias": (c,),
             "attn.qkv.weight": (3 * c, c), "attn.qkv.bias": (3 * c,), "attn.proj.weight": (c, c),
             "attn.proj.bias": (c,), "norm2.0.weight": (c,), "norm2.0.bias": (c,),
             "mlp.0.fc1.weight": (hidden, c), "mlp.0.fc1.bias": (hidden,), "mlp.0.fc2.weight": (c, hidden),
             "mlp.0.fc2.bias": (c,)}
    if rpe_rows:
        names["attn.rpe.rpe_table"] = (rpe_rows, heads)
    return {f"{prefix}.{k}": v for k, v in names.items()}


def upstream_backbone(variant: str, in_channels=6, enc_depths=(2, 2, 2, 6, 2), enc_channels=(32, 64, 128, 256, 512),
                      dec_depths=(2, 2, 2, 2), dec_channels=(64, 64, 128, 256)) -> dict:
    """Upstream's default PT-v3m1 / PT-v3m2 backbone, stage by stage."""
    c0 = enc_channels[0]
    if variant == "PT-v3m1":  # Embedding: SubMConv3d(k=5, bias=False) as "conv", LayerNorm as "norm"
        names = {"embedding.stem.conv.weight": (c0, 5, 5, 5, in_channels)}
    else:  # Embedding: Linear as "linear", LayerNorm as "norm"
        names = {"embedding.stem.linear.weight": (c0, in_channels), "embedding.stem.linear.bias": (c0,)}
    names.update({"embedding.stem.norm.weight": (c0,), "embedding.stem.norm.bias": (c0,)})
    for s, (depth, c) in enumerate(zip(enc_depths, enc_channels)):
        if s > 0:  # SerializedPooling / GridPooling: proj Linear, norm PointSequential(LayerNorm)
            cin = enc_channels[s - 1]
            names.update({f"enc.enc{s}.down.proj.weight": (c, cin), f"enc.enc{s}.down.proj.bias": (c,),
                          f"enc.enc{s}.down.norm.0.weight": (c,), f"enc.enc{s}.down.norm.0.bias": (c,)})
        for i in range(depth):
            names.update(upstream_block(f"enc.enc{s}.block{i}", c))
    widths = list(dec_channels) + [enc_channels[-1]]
    for s in reversed(range(len(enc_channels) - 1)):
        c, cin, skip = widths[s], widths[s + 1], enc_channels[s]
        p = f"dec.dec{s}.up"  # proj / proj_skip: PointSequential(Linear, LayerNorm, GELU)
        names.update({f"{p}.proj.0.weight": (c, cin), f"{p}.proj.0.bias": (c,), f"{p}.proj.1.weight": (c,),
                      f"{p}.proj.1.bias": (c,), f"{p}.proj_skip.0.weight": (c, skip), f"{p}.proj_skip.0.bias": (c,),
                      f"{p}.proj_skip.1.weight": (c,), f"{p}.proj_skip.1.bias": (c,)})
        for i in range(dec_depths[s]):
            names.update(upstream_block(f"dec.dec{s}.block{i}", c))
    return names


def shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def write_upstream_file(path, listing: dict, prefix: str = "module.", seed: int = 0) -> dict:
    """An upstream-style checkpoint: ``{"state_dict": {prefix + name: tensor}}`` with random values."""
    g = torch.Generator().manual_seed(seed)
    state = {prefix + k: torch.randn(v, generator=g) for k, v in listing.items()}
    torch.save({"epoch": 3, "state_dict": state}, path)
    return state


def test_tiny_semseg_model_has_upstreams_names_and_shapes():
    assert shapes(MODELS.build(TINY_MODEL)) == parse(TINY_UPSTREAM)


@pytest.mark.parametrize("variant", ["PT-v3m1", "PT-v3m2"])
def test_full_default_backbone_has_upstreams_names_and_shapes(variant):
    model = MODELS.build(dict(type=variant))
    expect = upstream_backbone(variant)
    assert shapes(model) == expect
    # stem (conv | linear weight+bias) + its norm, 4 poolings, 14 encoder blocks, 4 un-poolings, 8 decoder blocks
    assert len(expect) == (1 if variant == "PT-v3m1" else 2) + 2 + 4 * 4 + 14 * 18 + 4 * 8 + 8 * 18


def test_v3m2_options_that_add_parameters_add_upstreams():
    model = MODELS.build(dict(type="PT-v3m2", enc_depths=(1, 1), enc_channels=(8, 16), enc_num_head=(1, 1),
                              enc_patch_size=(8, 8), stride=(2,), dec_depths=(1,), dec_channels=(8,), dec_num_head=(1,),
                              dec_patch_size=(8,), layer_scale=1e-5, mask_token=True, enable_rpe=True,
                              enable_flash=False, upcast_attention=True, upcast_softmax=True))
    got = shapes(model)
    assert got["embedding.mask_token"] == (1, 8)
    assert got["enc.enc0.block0.ls1.0.gamma"] == (8,) and got["dec.dec0.block0.ls2.0.gamma"] == (8,)
    # RPE table: 3 * (2 * int((4 * 8) ** (1/3) * 2) + 1) rows, one column per head
    assert got["enc.enc1.block0.attn.rpe.rpe_table"] == (3 * (2 * int((4 * 8) ** (1 / 3) * 2) + 1), 1)
    shared = MODELS.build(dict(type="PT-v3m2", enc_depths=(2, 1), enc_channels=(8, 16), enc_num_head=(1, 1),
                               enc_patch_size=(8, 8), stride=(2,), dec_depths=(1,), dec_channels=(8,),
                               dec_num_head=(1,), dec_patch_size=(8,), cpe_shared_weight=True))
    sd = shared.state_dict()
    assert sd["shared_cpe_convs.enc_stage0.weight"].shape == (8, 3, 3, 3, 8)
    assert sd["enc.enc0.block1.cpe.0.weight"].data_ptr() == sd["enc.enc0.block0.cpe.0.weight"].data_ptr()
    first_only = MODELS.build(dict(type="PT-v3m2", enc_depths=(2, 1), enc_channels=(8, 16), enc_num_head=(1, 1),
                                   enc_patch_size=(8, 8), stride=(2,), dec_depths=(2,), dec_channels=(8,),
                                   dec_num_head=(1,), dec_patch_size=(8,), cpe_first_layer_only=True))
    keys = set(first_only.state_dict())
    assert "enc.enc0.block0.cpe.0.weight" in keys and not any(k.startswith("enc.enc0.block1.cpe") for k in keys)


def test_upstream_checkpoint_loads_strictly_through_checkpoint_loader_renaming(tmp_path):
    """A fine-tuning file from a Sonata-style run: the backbone under
    ``module.student.backbone``, renamed the way upstream configs do."""
    listing = parse(TINY_UPSTREAM)
    renamed = {("student." + k if k.startswith("backbone.") else k): v for k, v in listing.items()}
    state = write_upstream_file(tmp_path / "ft.pth", renamed)
    hook = CheckpointLoader(keywords="module.student.backbone", replacement="module.backbone", strict=True)
    model = MODELS.build(TINY_MODEL)
    report = load_weights(model, tmp_path / "ft.pth", hook.key_map, strict=hook.strict, allow_unexpected=False)
    assert report["loaded"] == len(listing) and not report["missing"] and not report["unexpected"]
    own = model.state_dict()
    for key, value in state.items():
        name = key.removeprefix("module.").replace("student.backbone.", "backbone.")
        assert torch.equal(own[name], value), name  # copied as they are, the spconv weights included


def test_strict_load_names_missing_and_left_over_tensors(tmp_path):
    listing = parse(TINY_UPSTREAM)
    extra = dict(listing, **{"backbone.teacher_head.weight": (4, 4)})
    write_upstream_file(tmp_path / "extra.pth", extra)
    hook = CheckpointLoader(strict=True)
    with pytest.raises(CheckpointError, match="not in the model: backbone.teacher_head.weight"):
        load_weights(MODELS.build(TINY_MODEL), tmp_path / "extra.pth", hook.key_map, strict=True,
                     allow_unexpected=False)
    short = {k: v for k, v in listing.items() if "dec0.block0.cpe.0" not in k}
    write_upstream_file(tmp_path / "short.pth", short)
    with pytest.raises(CheckpointError, match="not in the file: backbone.dec.dec0.block0.cpe.0.weight"):
        load_weights(MODELS.build(TINY_MODEL), tmp_path / "short.pth", strict=True, allow_unexpected=False)
    # without strict, a warm start keeps what fits and says what it skipped
    report = load_weights(MODELS.build(TINY_MODEL), tmp_path / "extra.pth")
    assert report["unexpected"] == ["backbone.teacher_head.weight"] and report["loaded"] == len(listing)


def test_checkpoint_loader_rules_follow_upstream():
    hook = CheckpointLoader(replacements={"module.backbone": "module.model.backbone", "module.backbone.enc": "x.enc"})
    assert hook.key_map == [("backbone.enc", "x.enc"), ("backbone", "model.backbone")]  # longest first
    assert CheckpointLoader(keywords="", replacement="anything").key_map == []  # an empty keyword matches nothing
    assert CheckpointLoader(keywords="module.a").key_map == [("a", "a")]
    with pytest.raises(ValueError, match="replacements"):
        CheckpointLoader(replacements=[("a", "b")])
