"""fairseq-deepinit: deep-Transformer initialisation, normalisation and residual schemes as a
fairseq ``--user-dir`` plugin. Importing the package registers the ``deepinit`` model, its named
architectures, the ``tfixup`` lr scheduler, makes fairseq checkpoints loadable under torch >= 2.6, and
makes the plugin's errors end a fairseq command with one line and exit status 1 (:mod:`.errors`).
"""

from . import checkpoint_compat, errors

# plugin errors end fairseq commands with one line and status 1, and fairseq's prefetching threads
# are stopped before the interpreter exits (see errors.py); installed first, so that it also covers
# errors raised while the rest of the plugin registers itself
errors.install()
checkpoint_compat.install()

# isort: off
# the model must be registered before its architectures
from . import model  # noqa: E402,F401
from . import architectures, tfixup_schedule  # noqa: E402,F401
from . import admin, admin_task  # noqa: E402,F401  (Admin: --residual-scale admin, --task translation_admin)
from . import matt  # noqa: E402,F401  (registers --decoder-layer-type matt before args are parsed)
from . import diagnostics_criterion  # noqa: E402,F401  (--criterion label_smoothed_cross_entropy_diagnostics)
from . import radam  # noqa: E402,F401  (--optimizer radam, Admin's recipes)
from . import autocast  # noqa: E402,F401  (--task translation_deepinit with --autocast-bf16)
# isort: on

__version__ = "0.1.0"
