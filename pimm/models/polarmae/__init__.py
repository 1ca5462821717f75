"""PoLAr-MAE: masked point modelling pre-training and its segmentation fine-tune."""

from .model import TOKENIZER_PRESETS, PoLArMAE, PoLArMAESemSeg

__all__ = ["PoLArMAE", "PoLArMAESemSeg", "TOKENIZER_PRESETS"]
