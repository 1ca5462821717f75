"""What to use instead of the data sets and transforms upstream pimm registers
that pimm does not build (yet): naming one in a config is one line saying so
(the registry's hint). A name that gets registered is found first, so its
hint is then never shown; ``tools/upstream_registry_table.py`` lists which
names are built, from the live registries."""

from __future__ import annotations

from pimm.engines.registries import DATASETS, TRANSFORMS

__all__ = ["DATASET_HINTS", "TRANSFORM_HINTS"]

_OWN = "write a transform of your own (docs/own-data.md)"
_COLOUR = ("an RGB colour augmentation; pimm's detector points carry deposited energy, not colour: "
           "use RandomJitter / MultiplicativeRandomJitter on the energy, or " + _OWN)

DATASET_HINTS = {
    "DefaultDataset": "not built here: convert the scenes to HDF5 and use PILArNetH5Dataset, or see docs/own-data.md",
    "ConcatDataset": "not built here: give one data set several files/splits (PILArNetH5Dataset split=[...])",
    "JAXTPCDataset": "JAXTPC simulation files are not read here; use LArTPCSynthDataset (docs/pilarnet.md)",
    "LUCiDDataset": "water-Cherenkov (LUCiD) files are not read here; CherenkovRingDataset simulates PMT rings",
    "LUCiDEventSSLDataset": "water-Cherenkov (LUCiD) files are not read here; CherenkovRingDataset simulates PMT rings",
    "PILArNetParquetDataset": "use PILArNetH5Dataset (the same events from PILArNet-M's HDF5 files)",
    "PILArNetParquetIterableDataset": "use PILArNetH5Dataset (the same events from PILArNet-M's HDF5 files)",
}

TRANSFORM_HINTS = {name: _COLOUR for name in (
    "ChromaticAutoContrast", "ChromaticJitter", "ChromaticTranslation", "HueSaturationTranslation",
    "NormalizeColor", "RandomColorDrop", "RandomColorGrayScale", "RandomColorJitter")}
TRANSFORM_HINTS.update({
    "EnergyJitter": "use MultiplicativeRandomJitter on the energy (a relative jitter)",
    "ClipGaussianJitter": "use RandomJitter (sigma, clip)",
    "EnergeticTranslation": "use RandomJitter on the energy, or " + _OWN,
    "RelativeLogNormalize": "use LogTransform (log energy, optionally clipped), or " + _OWN,
    "ComputeAnchors": _OWN,
    "ConditionalRandomTransform": _OWN,
    "ContrastiveViewsGenerator": "use MultiViewGenerator (pimm's multi-view generator for Sonata pre-training)",
    "MixedScaleGeometryMultiViewGenerator": "use MultiViewGenerator",
    "CropBoundary": _OWN, "HardExampleCrop": _OWN, "PointClip": _OWN, "SphereCrop": _OWN,
    "RandomDrop": _OWN, "RandomDropout": _OWN, "ElasticDistortion": _OWN,
    "RandomShift": "use CenterShift or NormalizeCoord, or " + _OWN,
    "PositiveShift": "use CenterShift or NormalizeCoord, or " + _OWN,
    "RandomRotateTargetAngle": "use RandomRotate with angle=[a, a] (a fixed angle)",
    "SetRandomValue": _OWN,
    "InstanceParser": "pimm's instance models compute their targets from 'instance' themselves (PointGroupLite)",
    "LocalCovarianceFeatures": _OWN,
    "MomentumTransform": _OWN,
    "PDGToSemantic": "give the data set's semantic labels (segment) directly, or " + _OWN,
})

for _name, _hint in DATASET_HINTS.items():
    DATASETS.add_hint(_name, _hint)
for _name, _hint in TRANSFORM_HINTS.items():
    TRANSFORMS.add_hint(_name, _hint)
