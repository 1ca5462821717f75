"""Models that travel (upstream pimm's ``pimm.export``): export folders written
by :func:`save_pretrained` and pushed by :func:`push_to_hub`, models loaded by
:func:`from_pretrained`, and the state-dict helpers they use.

Weight files, export folders and the configs beside them are data: loading
one never runs or imports code (:mod:`pimm.export.configs`, docs/security.md).
"""

from pimm.export.checkpoint import (clean_state_dict, filter_state_dict_by_prefix, load_checkpoint_metadata,
                                    load_pretrained, load_state_dict_from_checkpoint, remap_state_dict_keys)
from pimm.export.push import push_to_hub
from pimm.export.loading import from_pretrained
from pimm.export.saving import save_pretrained

__all__ = ["clean_state_dict", "filter_state_dict_by_prefix", "from_pretrained", "load_checkpoint_metadata",
           "load_pretrained", "load_state_dict_from_checkpoint", "push_to_hub", "remap_state_dict_keys",
           "save_pretrained"]
