# The runtime base ships inside the package: pimm/configs/_base_/default_runtime.py, generated
# from pimm/engines/runtime.py. This file only points at it, so the repository's configs keep
# writing _base_ = "../_base_/default_runtime.py"; a config anywhere else writes the line below.
_base_ = "pimm://_base_/default_runtime.py"
