"""The ``deepinit`` fairseq model: fairseq's TransformerModel with four independent axes.

- norm position per stack: fairseq's ``--encoder-normalize-before`` / ``--decoder-normalize-before``
  (Post-LN "v1" when off, Pre-LN "v2"/T2T when on; Xu et al. 2020 eq. 1-2);
- norm type: ``--norm-type`` (:mod:`fairseq_deepinit.norms`), plus ``--fixnorm`` embeddings;
- residual scaling: ``--residual-scale`` (:mod:`fairseq_deepinit.residual`);
- init scheme: ``--init-scheme`` (:mod:`fairseq_deepinit.schemes`), applied once after building.

Everything is wired through fairseq's extension points (``build_embedding``,
``build_encoder``/``build_decoder``, ``build_*_layer``, ``build_output_projection``,
``residual_connection``); the forward passes are fairseq's own.
"""

from __future__ import annotations

import logging

from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)

from . import options
from .checkpoints import config_check
from .modules.attention import declare_target_padding, future_mask, target_padding
from .modules.fixnorm import FixNormEmbedding, FixNormOutputProjection
from .modules.layers import DECODER_LAYER_TYPES, DeepInitEncoderLayer
from .modules.norms import build_optional_norm
from .schemes import apply_init_scheme
from .training import distributed
from .training.activation_checkpoint import checkpoint_wrapper

logger = logging.getLogger(__name__)


def _wrap_layer(cfg, layer):
    """fairseq's activation-checkpoint / FSDP wrapping of a freshly built layer (fairseq's
    ``TransformerEncoderBase.build_encoder_layer``), with the checkpoint's recompute under the forward's
    autocast state (:mod:`.training.activation_checkpoint`)."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


def _replace_stack_norms(module, cfg, embed_dim: int) -> None:
    """Swap the stack-level norms fairseq built (final Pre-LN norm, embedding norm)."""
    for attr in ("layer_norm", "layernorm_embedding"):
        if getattr(module, attr, None) is not None:
            setattr(module, attr, build_optional_norm(cfg.norm_type, embed_dim, cfg.norm_eps, cfg.export))


def _keep_version(module, state_dict, name: str) -> None:
    """Read a state dict without ``<name>.version`` as one of this version, not as a pre-2019 one.

    fairseq takes a missing key for version 1 and then removes the stack's final norm
    (fairseq/models/transformer/transformer_encoder.py:340-345, transformer_decoder.py:430-435). Every
    checkpoint of this plugin has the key, but fairseq's EMA loads its averages without it (it skips
    "version" keys, fairseq/models/ema/ema.py:164-174), which removed the EMA model's final Pre-LN norm
    (and left its weights out of the EMA) without a word.
    """
    state_dict.setdefault(f"{name}.version", module.version.detach().clone())


class DeepInitEncoder(TransformerEncoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, return_fc: bool = False) -> None:
        self._built_layers = 0
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        _replace_stack_norms(self, cfg, embed_tokens.embedding_dim)

    def build_encoder_layer(self, cfg):
        self._built_layers += 1
        return _wrap_layer(cfg, DeepInitEncoderLayer(cfg, self._built_layers, return_fc=self.return_fc))

    def upgrade_state_dict_named(self, state_dict, name):
        _keep_version(self, state_dict, name)
        return super().upgrade_state_dict_named(state_dict, name)


class DeepInitDecoder(TransformerDecoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn: bool = False, output_projection=None) -> None:
        self._built_layers = 0
        super().__init__(
            cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn, output_projection=output_projection
        )
        _replace_stack_norms(self, cfg, self.embed_dim)

    def build_decoder_layer(self, cfg, no_encoder_attn: bool = False):
        self._built_layers += 1
        layer_cls = DECODER_LAYER_TYPES[cfg.decoder_layer_type]
        return _wrap_layer(cfg, layer_cls(cfg, self._built_layers, no_encoder_attn=no_encoder_attn))

    def buffered_future_mask(self, tensor):
        """fairseq's cached ``triu(-inf, 1)`` (transformer_decoder.py, ``buffered_future_mask``), built by
        :func:`~fairseq_deepinit.modules.attention.future_mask` in ``tensor``'s dtype and device, so that
        the SDPA attention knows it is the causal mask without reading it back (a device sync)."""
        dim = tensor.size(0)
        mask = self._future_mask
        if mask.size(0) < dim or mask.device != tensor.device or mask.dtype != tensor.dtype:
            self._future_mask = mask = future_mask(dim, tensor)
        return mask[:dim, :dim]

    def build_output_projection(self, cfg, dictionary, embed_tokens):
        if cfg.fixnorm:
            self.output_projection = FixNormOutputProjection(embed_tokens)
            return
        super().build_output_projection(cfg, dictionary, embed_tokens)

    def upgrade_state_dict_named(self, state_dict, name):
        """fairseq's upgrade, with the version kept (:func:`_keep_version`), minus its pre-0.10 fix-up where it
        does not apply to FixNorm.

        fairseq copies ``embed_tokens.weight`` into ``output_projection.weight`` whenever that key
        is missing, for checkpoints written before the output projection was a module. The FixNorm
        projection has no weight of its own (it scores against the embedding it holds, stored as
        ``output_projection.embedding.weight``), so that copy would be an unexpected key under
        strict loading; it is dropped again here, and only when fairseq itself added it.
        """
        _keep_version(self, state_dict, name)
        key = f"{name}.output_projection.weight"
        had_key = key in state_dict
        state_dict = super().upgrade_state_dict_named(state_dict, name)
        if isinstance(self.output_projection, FixNormOutputProjection) and not had_key:
            state_dict.pop(key, None)
        return state_dict


@register_model("deepinit")
class DeepInitTransformerModel(TransformerModel):
    """fairseq's ``transformer`` with composable deep-Transformer schemes (see the README)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        options.add_model_args(parser)
        config_check.add_args(parser)  # --allow-config-change

    @classmethod
    def build_model(cls, args, task):
        distributed.check_ddp_backend(args)  # before any model work (fairseq-hydra-train, scripts)
        options.resolve_and_validate(args)
        model = super().build_model(args, task)
        declare_target_padding(model.decoder, target_padding(task))
        apply_init_scheme(model, TransformerConfig.from_namespace(args))
        logger.info(options.describe(args))
        return model

    @classmethod
    def build_embedding(cls, args, dictionary, embed_dim, path=None):
        if getattr(args, "fixnorm", False):
            if path:
                raise ValueError("--fixnorm learns its own normalised embeddings; drop --*-embed-path")
            return FixNormEmbedding(len(dictionary), embed_dim, padding_idx=dictionary.pad())
        return super().build_embedding(args, dictionary, embed_dim, path)

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return DeepInitEncoder(TransformerConfig.from_namespace(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return DeepInitDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)
