"""fairseq-deepinit: deep-Transformer initialisation, normalisation and residual schemes as a
fairseq ``--user-dir`` plugin.

Importing the package registers the ``deepinit`` model and its named architectures, the MAtt layer
type, Admin's residual scaling and task, the diagnostics criterion, the ``tfixup`` lr scheduler and
the ``radam`` optimizer; makes fairseq checkpoints loadable under torch >= 2.6; and makes checkpoint
saving and resuming survive a killed run.

Layout: :mod:`.modules` (norms, FixNorm, residual scaling, attention, layers), :mod:`.schemes` (one
module per initialisation paper), :mod:`.admin`, :mod:`.matt`, :mod:`.diagnostics`,
:mod:`.checkpoints`, :mod:`.training` (tasks, optimizer, scheduler), :mod:`.lm` (decoder-only
language models: ``deepinit_lm``); :mod:`.options` and
:mod:`.errors` are the one home of the model's options and the plugin's errors.
"""

from . import errors
from .checkpoints import compat, resume

# plugin errors end fairseq commands with one line and status 1, and fairseq's prefetching threads
# are stopped before the interpreter exits (errors.py); installed first, so that it also covers
# errors raised while the rest of the plugin registers itself
errors.install()
compat.install()
resume.install()  # atomic checkpoint copies, resume fallback, one-line errors for damaged checkpoints

# isort: off
# the model must be registered before its architectures
from . import model  # noqa: E402,F401
from . import architectures  # noqa: E402,F401
from . import admin  # noqa: E402,F401  (Admin: --residual-scale admin, --task translation_admin, export)
from . import matt  # noqa: E402,F401  (registers --decoder-layer-type matt before args are parsed)
from .modules import b2t, normformer, subln  # noqa: E402,F401  (B2T, NormFormer, Sub-LN options)
from .diagnostics import criterion  # noqa: E402,F401  (--criterion label_smoothed_cross_entropy_diagnostics)
from .training import adam_foreach, autocast, radam, tfixup_schedule  # noqa: E402,F401  (task, optimizers, lr scheduler)
from . import lm  # noqa: E402,F401  (decoder-only language models: deepinit_lm, after every family)
from .training import distributed  # noqa: E402  (last: every architecture is registered by now)
from . import intercepts  # noqa: E402
# isort: on

adam_foreach.install()  # adam <-> adam_foreach resume; --adam-betas read as a literal (training/adam_foreach.py)

distributed.guard_architectures("deepinit_lm")
distributed.guard_architectures()  # refuse --ddp-backend fully_sharded right after parsing (training/distributed.py)
intercepts.install()  # task/architecture mismatch, empty splits, data of another dictionary: one line (intercepts.py)

__version__ = "0.2.0.dev0"
