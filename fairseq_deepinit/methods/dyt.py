"""DyT, Dynamic Tanh (Zhu, Chen, He, LeCun, Liu 2025, "Transformers without Normalization", eq. 1):
``--norm-type dyt``, every norm of the model replaced by ``weight * tanh(alpha x) + bias``.

The block is :class:`~fairseq_deepinit.modules.dyt.DyT` (jiachenzhu/DyT @ aab5dde ``dynamic_tanh.py:6-23``:
one learnable scalar ``alpha``, initialised 0.5; per-channel ``weight`` ones and ``bias`` zeros); the norm
type is built wherever ``--norm-type`` builds a norm: the sub-layer norms in fairseq's slots, the stacks'
final Pre-LN norms, ``--layernorm-embedding``, Sub-LN's and NormFormer's extra norms, MAtt's norm.

Options (owned by ``--norm-type dyt``; :mod:`.derf` has the same ones for ``--norm-type derf``; both from
:mod:`.pointwise`):

- ``--dyt-alpha-init``: one value for every norm (released: 0.5), or per norm position as the LLaMA code
  (``other_tasks/LLaMA/fms_fsdp/models/llama.py:73-75,85-92,245-248``): ``attn,ffn,final`` = the norm
  before each attention (self and cross), before each FFN, and the stacks' final norms; a norm without a
  released position (the embedding norm, Sub-LN's and NormFormer's inner norms) takes ``ffn``'s, the
  value of "the others" beside attention. A released preset names the README's values per LLaMA 2
  size (:data:`~fairseq_deepinit.modules.dyt.RELEASED_ALPHA_INIT`). Per-position values are the
  released Pre-LN positions: with a Post-LN stack, fairseq's ``self_attn_layer_norm`` normalises the
  attention's output, the FFN's input, so they are refused there (one value still applies).
- ``--no-dyt-bias``: the LLaMA variant ``weight * tanh(alpha x)`` (``llama.py:32-46``).
- ``--dyt-embed-scale``: the LLaMA code's learnable scalar on the token embedding (``llama.py:208-209``,
  init sqrt(d) at ``275``, used at ``383``): fairseq's ``embed_scale`` (sqrt(d), or 1 with
  ``--no-scale-embedding``) made a parameter, its value at init unchanged; ``auto``: learnable for a
  decoder-only model (as both released language models), fixed for translation (no release).

No eps: ``--norm-eps`` is refused (nothing is divided; :func:`fairseq_deepinit.resolve.resolve`).
"""

from __future__ import annotations

from ..modules.dyt import DYT_ALPHA_INIT
from .pointwise import pointwise_hooks, pointwise_options
from .record import Method

METHOD = Method(
    name="dyt",
    title="DyT (Dynamic Tanh)",
    paper="Zhu, Chen, He, LeCun, Liu 2025, eq. 1",
    summary="every norm replaced by `weight * tanh(alpha x) + bias` (scalar alpha); per-position alpha, no bias "
    "and a learnable embedding scale as the LLaMA code",
    code="jiachenzhu/DyT @ aab5dde dynamic_tanh.py:6-23; other_tasks/LLaMA/fms_fsdp/models/llama.py:32-46,208-209,383",
    enabled_by="norm_type=dyt",
    options=pointwise_options("dyt", DYT_ALPHA_INIT, "DyT"),
    **pointwise_hooks("dyt"),
    # Pre-LN, the released language models' placement
    families={"dyt": dict(norm_type="dyt", norm_placement="pre")},
)
