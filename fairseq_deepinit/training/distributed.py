"""Start-up checks for data-parallel training with the ``deepinit`` model.

``--ddp-backend fully_sharded`` is refused. fairseq 0.12's FSDP is fairscale's
``FullyShardedDataParallel`` (fairscale is not in the pinned stack; its last release, 0.4.13,
builds against torch 2.13 but runs on CUDA only), and it flattens and shards parameters in a way
the plugin cannot work with:

- with per-layer wrapping (``--checkpoint-activations``, or ``--min-params-to-wrap`` below a
  layer's size) each layer is flattened and sharded as it is built, *before* the init scheme
  writes its weights: the scheme writes into freed storage (a segmentation fault in
  ``xavier_uniform_`` on torch 2.13) or into views no rank uses again;
- with whole-model wrapping every parameter becomes one flat shard, so what the plugin reads or
  writes per module after the model is built (Admin's profiled ``omega``, ReZero's ``alpha`` and
  the per-layer statistics of the diagnostics criterion) is no longer there.

fairseq enters its FSDP wrapping context *before* it calls the model's ``build_model`` (and that
context already fails with an ImportError where fairscale is missing, advising to install it), so
the check also runs right after argument parsing: :func:`fairseq_deepinit.patches.guard_architectures`
makes every ``deepinit`` architecture function, which fairseq calls on the parsed arguments, check first.
"""

from __future__ import annotations

from typing import Any

from ..errors import DeepInitConfigError

FULLY_SHARDED_MESSAGE = (
    "--ddp-backend fully_sharded is not supported with the deepinit model: fairseq 0.12's FSDP is "
    "fairscale's (CUDA only, not installed by this project), which flattens and shards the parameters that "
    "the init schemes, Admin's profiling and the diagnostics address per module; use --ddp-backend "
    "pytorch_ddp (fairseq's default; legacy_ddp or no_c10d on CPU) instead"
)


def check_ddp_backend(args: Any) -> None:
    """Raise :class:`DeepInitConfigError` for a data-parallel backend the plugin cannot train with."""
    if getattr(args, "ddp_backend", None) == "fully_sharded":
        raise DeepInitConfigError(FULLY_SHARDED_MESSAGE)
