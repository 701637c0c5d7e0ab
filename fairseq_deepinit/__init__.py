"""fairseq-deepinit: deep-Transformer initialisation, normalisation and residual schemes as a
fairseq ``--user-dir`` plugin.

Importing the package registers the ``deepinit`` and ``deepinit_lm`` models and their named
architectures (every method of :mod:`.methods`), Admin's profiling tasks, the diagnostics criteria,
the ``translation_deepinit`` task, the ``tfixup`` lr scheduler and the ``radam`` / ``adam_foreach``
optimizers; makes fairseq checkpoints loadable under torch >= 2.6; and makes checkpoint saving and
resuming survive a killed run.

Layout (docs/architecture.md has the picture): :mod:`.errors`; :mod:`.modules` (plain building
blocks: norms, FixNorm, residual modules, attention, the layers); :mod:`.matt` (MAtt's layer);
:mod:`.methods` (one record per method); :mod:`.options`, :mod:`.architectures` and :mod:`.plan`
(computed from the records); :mod:`.model` and :mod:`.lm` (the models); :mod:`.admin` (Admin's
profiling, tasks and export), :mod:`.diagnostics`, :mod:`.checkpoints`, :mod:`.training`.
"""

from . import errors
from .checkpoints import broadcast, compat, resume

# plugin errors end fairseq commands with one line and status 1, and fairseq's prefetching threads
# are stopped before the interpreter exits (errors.py); installed first, so that it also covers
# errors raised while the rest of the plugin registers itself
errors.install()
compat.install()
resume.install()  # atomic checkpoint copies, resume fallback, one-line errors for damaged checkpoints
broadcast.install()  # on resume, rank 0's checkpoint state reaches the other ranks (checkpoints/broadcast.py)

# fairseq registrations (models, architectures, tasks, criteria, optimizers, schedulers); which import
# registers what is independent of their order: each module imports what it needs
from . import architectures, input_checks, intercepts, lm, model  # noqa: E402,F401  (deepinit, deepinit_lm, --arch)
from .admin import task  # noqa: E402,F401  (--task translation_admin)
from .diagnostics import criterion  # noqa: E402,F401  (--criterion label_smoothed_cross_entropy_diagnostics)
from .training import adam_foreach, autocast, depth_mup_trainer, distributed, launch, radam, tfixup_schedule  # noqa: E402,F401

adam_foreach.install()  # adam <-> adam_foreach resume; --adam-betas read as a literal (training/adam_foreach.py)
depth_mup_trainer.install()  # --depth-mup: per-group lr/eps reach the optimizer (training/depth_mup_trainer.py)
launch.install()  # torchrun on the CPU, wrong launches refused, --heartbeat-timeout in collectives (training/launch.py)

# refuse --ddp-backend fully_sharded right after parsing (training/distributed.py); after every
# architecture is registered (above)
distributed.guard_architectures(lm.model.MODEL_NAME)
distributed.guard_architectures(model.MODEL_NAME)
intercepts.install()  # task/architecture mismatch, empty splits, data of another dictionary: one line (intercepts.py)
input_checks.install()  # no data folder, duplicate dictionary words, too-long sentences, --beam 0 (input_checks.py)

__version__ = "0.2.0.dev0"
