"""What the plugin's encoder and decoder (:mod:`fairseq_deepinit.encoder`, :mod:`fairseq_deepinit.decoder`) do
alike: when fairseq builds them, wrap each new layer as fairseq does, swap the stack-level norms for the
spec's, and keep the state dict's version key; in their forwards, start and end the streams a method adds
beside or in place of the one residual stream (ResiDual's second stream, hyper-connections' ``n`` streams,
Attention Residuals' sources).
"""

from __future__ import annotations

from typing import Tuple

from fairseq.distributed import fsdp_wrap
from torch import Tensor

from . import plan
from .training.activation_checkpoint import checkpoint_wrapper


def wrap_layer(cfg, layer):
    """fairseq's activation-checkpoint / FSDP wrapping of a freshly built layer (fairseq's
    ``TransformerEncoderBase.build_encoder_layer``), with the checkpoint's recompute under the forward's
    autocast state (:mod:`.training.activation_checkpoint`)."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


def replace_stack_norms(module, spec, embed_dim: int) -> None:
    """Swap the stack-level norms fairseq built (final Pre-LN norm, at position ``final``; embedding norm)."""
    for attr, position in (("layer_norm", "final"), ("layernorm_embedding", None)):
        if getattr(module, attr, None) is not None:
            setattr(module, attr, plan.build_stack_norm(spec, embed_dim, position))


def keep_version(module, state_dict, name: str) -> None:
    """Read a state dict without ``<name>.version`` as one of this version, not as a pre-2019 one.

    fairseq takes a missing key for version 1 and then removes the stack's final norm
    (fairseq/models/transformer/transformer_encoder.py:340-345, transformer_decoder.py:430-435). Every
    checkpoint of this plugin has the key, but fairseq's EMA loads its averages without it (it skips
    "version" keys, fairseq/models/ema/ema.py:164-174), which removed the EMA model's final Pre-LN norm
    (and left its weights out of the EMA) without a word.
    """
    state_dict.setdefault(f"{name}.version", module.version.detach().clone())


def begin_streams(stack, x: Tensor) -> Tuple[Tensor, Tensor | None]:
    """At the embedding output ``x``: ``(the layers' input, ResiDual's second stream or None)``; the layers'
    input is ``n`` copies of ``x`` under hyper-connections, the first source under Attention Residuals
    (``stack.streams``), else ``x``."""
    raw = None if stack.dual_stream is None else stack.dual_stream.begin(x)
    return (x if stack.streams is None else stack.streams.expand(x)), raw


def hidden(stack, x: Tensor) -> Tensor:
    """A layer's output as one ``(T, B, C)`` stream (the hidden states a stack returns beside its output)."""
    return x if stack.streams is None else stack.streams.hidden(x)


def end_streams(stack, x: Tensor, raw: Tensor | None) -> Tensor:
    """The stack's output from its last layer's: one stream (the streams contracted), then ResiDual's close or the
    final norm."""
    x = x if stack.streams is None else stack.streams.contract(x)
    if raw is not None:
        return stack.dual_stream.close(x, raw, stack.layer_norm)
    return x if stack.layer_norm is None else stack.layer_norm(x)
