"""Decoder-only language models: every axis of the plugin on fairseq's ``transformer_lm``.

- :mod:`.model`: the ``deepinit_lm`` model (``--task language_modeling``), LM-specific validation;
- :mod:`.architectures`: ``<family>_lm<size>`` for every family, at fairseq's LM sizes plus deep ones;
- :mod:`.criterion`: ``--criterion cross_entropy_diagnostics`` (statistics and the divergence guard);
- :mod:`.task`: ``--task language_modeling_admin`` (Admin's omega profiled before the first update);
- :mod:`.export`: ``deepinit-export-admin-lm``, omega folded into a stock ``transformer_lm`` checkpoint.

Decoder-only formulas (docs/lm.md): DeepNorm alpha = (2N)^(1/4), beta = (8N)^(-1/4) (DeepNet, Table 1,
decoder-only); T-Fixup: the paper's decoder rules with N the decoder layers, (9N)^(-1/4) (this project's
extension); DS-Init is per layer (unchanged); Admin: the released code's recurrence over the one stack
(this project's extension); the successors by each layer's decoder-only kind (modules/stacks.py):
torchscale's DeepNorm divisor (8N)^(1/4), Sub-LN's gain sqrt(ln 2N), closed-form Admin's
calculate_init(2N). Importing the package registers all of it (:mod:`.export` is a command, imported on use).
"""

from . import architectures, criterion, model, task  # noqa: F401  (registration)
from .model import DeepInitLanguageModel, resolve_lm_args

__all__ = ["DeepInitLanguageModel", "resolve_lm_args"]
