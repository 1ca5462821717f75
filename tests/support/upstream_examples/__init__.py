"""Upstream pimm's four extension examples (docs/source/extend/add_hook.md,
add_model.md, add_transform.md, add_dataset.md of gregorkrz/particle-imaging-models),
transcribed as those pages show them, byte for byte in their code, so that a
test can check that they run on pimm unmodified. The only file that is not an
example is ``glue.py``: what the examples leave to the user (a backbone, a
dataset's ``get_data``, an evaluator), written the way an upstream user would.

``my_segmentor.py`` is the page's ``pimm/models/my_segmentor.py`` and
``tversky.py`` its ``pimm/models/losses/tversky.py``; the latter uses a
relative import (``from .builder import LOSSES``), so ``glue.py`` loads it as
``pimm.models.losses.tversky``, where the page puts it.
"""
