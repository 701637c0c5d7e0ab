"""fairseq-deepinit: deep-Transformer initialisation, normalisation and residual schemes as a
fairseq ``--user-dir`` plugin.

Importing the package registers the ``deepinit`` and ``deepinit_lm`` models and their named
architectures (every method of :mod:`.methods`), Admin's profiling tasks, the diagnostics criteria,
the ``translation_deepinit`` task, the ``tfixup`` lr scheduler and the ``radam`` / ``adam_foreach`` /
``muon`` optimizers; and applies the fairseq patches of :mod:`.patches` (checkpoints loadable under torch >= 2.6,
checkpoint saving and resuming that survive a killed run, one-line errors for bad input).

Layout (docs/architecture.md has the picture): :mod:`.errors`; :mod:`.modules` (plain building
blocks: norms, FixNorm, residual modules, attention, the layers); :mod:`.matt` (MAtt's layer);
:mod:`.methods` (one record per method); :mod:`.spec` and :mod:`.resolve` (the model's spec, resolved once
from the options; :mod:`.checks` its rules), :mod:`.options`, :mod:`.architectures` and :mod:`.plan`
(computed from the records and the spec); :mod:`.model` and :mod:`.lm` (the models); :mod:`.admin` (Admin's
profiling, tasks and export), :mod:`.diagnostics`, :mod:`.checkpoints`, :mod:`.training`; :mod:`.patches`
(every change to fairseq).
"""

from . import errors

# plugin errors end fairseq commands with one line and status 1, and fairseq's prefetching threads
# are stopped before the interpreter exits (errors.py); installed first, so that it also covers
# errors raised while the rest of the plugin registers itself
errors.install()

# fairseq registrations (models, architectures, tasks, criteria, optimizers, schedulers); which import
# registers what is independent of their order: each module imports what it needs
from . import architectures, lm, model, patches  # noqa: E402,F401  (deepinit, deepinit_lm and their --arch)
from .admin import task  # noqa: E402,F401  (--task translation_admin)
from .diagnostics import criterion  # noqa: E402,F401  (--criterion label_smoothed_cross_entropy_diagnostics)
from .training import adam_foreach, autocast, muon, radam, tfixup_schedule  # noqa: E402,F401

# every change to fairseq, listed with its reasons in patches.py; after every architecture is registered
patches.install()

__version__ = "0.2.0.dev0"
