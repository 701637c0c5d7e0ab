"""The ``deepinit`` fairseq model: fairseq's TransformerModel with four independent axes.

- norm position per stack: fairseq's ``--encoder-normalize-before`` / ``--decoder-normalize-before``
  (Post-LN "v1" when off, Pre-LN "v2"/T2T when on; Xu et al. 2020 eq. 1-2), or ``--norm-placement``
  (also Peri-LN's and OLMo 2's placements, :mod:`fairseq_deepinit.methods.placement`), a value per layer;
- norm type: ``--norm-type`` (:mod:`fairseq_deepinit.modules.norms`), plus ``--fixnorm`` embeddings;
- residual scaling: ``--residual-scale`` (:mod:`fairseq_deepinit.modules.residual`);
- init scheme: ``--init-scheme``, applied once after building;

each value contributed by a method's record, resolved once into the model's
:class:`~fairseq_deepinit.spec.ModelSpec`, which the build hooks read through :mod:`fairseq_deepinit.plan`.

Everything is built through fairseq's extension points (``build_embedding``,
``build_encoder``/``build_decoder``, ``build_*_layer``, ``build_output_projection``): the stacks are
:class:`~fairseq_deepinit.encoder.DeepInitEncoder` and :class:`~fairseq_deepinit.decoder.DeepInitDecoder`
(their forwards are fairseq's but for one host read each, and are the one place where a stack loops over
its layers), the layers :mod:`fairseq_deepinit.modules.layers`.
"""

from __future__ import annotations

import logging

from fairseq.models import register_model
from fairseq.models.transformer import TransformerConfig, TransformerModel

from . import model_config, options, plan, resolve
from .checkpoints import config_check
from .decoder import DeepInitDecoder
from .encoder import DeepInitEncoder
from .modules.padding import target_padding
from .training import distributed

logger = logging.getLogger(__name__)

MODEL_NAME = config_check.TRANSLATION_MODEL


@register_model(MODEL_NAME)
class DeepInitTransformerModel(TransformerModel):
    """fairseq's ``transformer`` with composable deep-Transformer schemes (see the README)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        options.add_model_args(parser)
        config_check.add_args(parser)  # --allow-config-change

    @classmethod
    def build_model(cls, args, task):
        cfg, args = args, model_config.as_namespace(args, task)  # fairseq-hydra-train's DictConfig: a Namespace
        distributed.check_ddp_backend(args)  # before any model work (fairseq-hydra-train, scripts)
        spec = options.resolve_and_validate(args)
        with plan.carried(args, spec):
            model = super().build_model(args, task)
        model.decoder.set_target_padding(target_padding(task))  # the task that batches the data
        plan.apply_init(model, spec)
        model.spec = spec
        model_config.keep_resolved(cfg, args)
        logger.info(resolve.describe(spec))
        return model

    @classmethod
    def build_embedding(cls, args, dictionary, embed_dim, path=None):
        embedding = plan.build_embedding(plan.spec_of(args), dictionary, embed_dim, path)
        return embedding if embedding is not None else super().build_embedding(args, dictionary, embed_dim, path)

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return DeepInitEncoder(TransformerConfig.from_namespace(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return DeepInitDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)


model_config.register(MODEL_NAME, model_config.DeepInitConfig)  # fairseq-hydra-train (model_config.py)
