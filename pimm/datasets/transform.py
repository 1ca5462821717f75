"""Upstream pimm's import path for transforms: ``from pimm.datasets.transform import
TRANSFORMS, Compose, SphereCrop, ...``. pimm's transforms live in
:mod:`pimm.datasets.transforms` and the modules next to it; every transform
upstream's package exports is importable from here under its name."""

from pimm.engines.registries import TRANSFORMS
from pimm.datasets.multiview import CenterShift, MultiplicativeRandomJitter, MultiViewGenerator
from pimm.datasets.multiview_extra import ContrastiveViewsGenerator, MixedScaleGeometryMultiViewGenerator
from pimm.datasets.transforms import (
    Collect, Compose, Copy, GridSample, NormalizeCoord, RandomFlip, RandomJitter, RandomRotate, RandomScale,
    ShufflePoint, ToTensor, Update, index_points,
)
from pimm.datasets.transforms_anchors import ComputeAnchors
from pimm.datasets.transforms_color import (
    ChromaticAutoContrast, ChromaticJitter, ChromaticTranslation, HueSaturationTranslation, NormalizeColor,
    RandomColorDrop, RandomColorGrayScale, RandomColorJitter,
)
from pimm.datasets.transforms_crop import CropBoundary, HardExampleCrop, RandomDrop, RandomDropout, SphereCrop
from pimm.datasets.transforms_energy import (
    EnergeticTranslation, EnergyJitter, LogTransform, MomentumTransform, RelativeLogNormalize,
)
from pimm.datasets.transforms_instance import InstanceParser, LocalCovarianceFeatures, PDGToSemantic
from pimm.datasets.transforms_spatial import (
    ClipGaussianJitter, ConditionalRandomTransform, ElasticDistortion, PointClip, PositiveShift, RandomShift,
    RandomRotateTargetAngle, SetRandomValue,
)



def index_operator(data_dict: dict, index, duplicate: bool = False) -> dict:
    """Upstream's name for :func:`~pimm.datasets.point_dict.index_points`: every
    per-point entry indexed together. The result is always a new dict (pimm never
    edits the one given), so ``duplicate`` changes nothing."""
    return index_points(data_dict, index)


__all__ = ["TRANSFORMS", "Compose", "index_operator", *sorted(
    name for name in dir() if name[0].isupper() and name not in ("TRANSFORMS", "Compose"))]
