"""fairseq-deepinit: deep-Transformer initialisation, normalisation and residual schemes as a
fairseq ``--user-dir`` plugin. Importing the package registers the ``deepinit`` model, its named
architectures, the ``tfixup`` lr scheduler, and makes fairseq checkpoints loadable under torch >= 2.6.
"""

from . import checkpoint_compat

checkpoint_compat.install()

from . import model  # noqa: E402  (registers the model before its architectures)
from . import architectures, tfixup_schedule  # noqa: E402,F401

__version__ = "0.1.0"
