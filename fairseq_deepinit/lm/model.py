"""The ``deepinit_lm`` fairseq model: fairseq's ``transformer_lm`` with the plugin's independent axes.

fairseq's :class:`~fairseq.models.transformer_lm.TransformerLanguageModel` (a decoder without
cross-attention, ``--task language_modeling``) built with the ``deepinit`` translation model's pieces
(:mod:`fairseq_deepinit.model`): ``build_embedding`` (FixNorm), the plugin's
:class:`~fairseq_deepinit.decoder.DeepInitDecoder` (whose ``build_decoder_layer`` and
``build_output_projection`` place the norm type, residual scaling and FixNorm), then the init scheme
(:mod:`fairseq_deepinit.plan`). fairseq's ``build_model`` has no hook for its decoder: see
:meth:`DeepInitLanguageModel.build_model`. The options are the translation model's
(:func:`fairseq_deepinit.options.add_model_args`), resolved and validated by the same
:func:`~fairseq_deepinit.options.resolve_and_validate`.

A decoder-only model is stored with ``encoder_layers = 0`` (which its spec resolves to no encoder stack,
:func:`fairseq_deepinit.resolve.resolve`). Its layers are built without
cross-attention, so each carries the decoder-only :class:`~fairseq_deepinit.modules.stacks.StackKind`,
from which DeepNorm (both variants), Sub-LN and closed-form Admin take their decoder-only constants.

Differences from fairseq's ``transformer_lm`` on purpose: fairseq's ``base_lm_architecture`` forces
Pre-LN ("model training is not stable without this"); here the norm position is an axis like the
others (``--decoder-normalize-before``), and the plain ``deepinit_lm`` architecture is Post-LN, as
the translation model's ``deepinit`` (every init scheme of the papers starts from Post-LN).
"""

from __future__ import annotations

import logging

from fairseq import options as fairseq_options
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model
from fairseq.models.transformer import TransformerConfig
from fairseq.models.transformer_lm import (
    DEFAULT_MAX_TARGET_POSITIONS,
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
)
from fairseq.modules import AdaptiveInput, CharacterTokenEmbedder

from .. import model_config, options, plan, resolve
from ..checkpoints import config_check
from ..decoder import DeepInitDecoder
from ..errors import DeepInitConfigError
from ..modules.padding import target_padding
from ..training import distributed

logger = logging.getLogger(__name__)

MODEL_NAME = config_check.LM_MODEL


def validate_lm_args(args) -> None:
    """What a decoder-only model's embedding cannot do, checked before the shared resolution:
    ``--adaptive-input`` / ``--character-embeddings`` replace the word-embedding matrix that FixNorm normalises
    and that Lipschitz and T-Fixup re-initialise / scale. (A layer type that needs cross-attention, MAtt,
    says so in its record.)
    """
    replaced = [f for f in ("adaptive_input", "character_embeddings") if getattr(args, f, False)]
    if replaced:
        flag = "--" + replaced[0].replace("_", "-")
        if getattr(args, "fixnorm", False):
            raise DeepInitConfigError(
                f"--fixnorm normalises the word-embedding matrix, which {flag} replaces; drop one"
            )
        if getattr(args, "init_scheme", None) in plan.embedding_schemes():
            raise DeepInitConfigError(
                f"--init-scheme {args.init_scheme} initialises the word-embedding matrix, which {flag} replaces; "
                "drop it or use another --init-scheme"
            )


def resolve_lm_args(args):
    """Decoder-only facts, LM validation, then the shared resolution, stored in ``args``; returns the spec."""
    args.encoder_layers = 0  # decoder-only: see the module docstring
    validate_lm_args(args)
    return options.resolve_and_validate(args)


@register_model(MODEL_NAME)
class DeepInitLanguageModel(TransformerLanguageModel):
    """fairseq's ``transformer_lm`` with composable deep-Transformer schemes (docs/lm.md)."""

    @classmethod
    def add_args(cls, parser) -> None:
        # registered without a dataclass (the translation model's argparse options need a Namespace),
        # so fairseq's transformer_lm options are added here as its own add_args would
        gen_parser_from_dataclass(parser, TransformerLanguageModelConfig(), delete_default=True)
        options.add_model_args(parser)
        config_check.add_args(parser)  # --allow-config-change

    @classmethod
    def build_model(cls, args, task):
        """fairseq's ``TransformerLanguageModel.build_model`` (fairseq/models/transformer_lm.py:269-317) with
        the plugin's decoder.

        fairseq's method builds its decoder by calling the class ``TransformerDecoder`` directly (lines
        314-316), with no ``build_decoder`` hook to override, so it cannot build the plugin's decoder: this
        method repeats its steps with :meth:`build_decoder` in that place. Calling fairseq's and replacing
        the decoder afterwards would build (and draw the random init of) a second, unused decoder, which
        changes every weight drawn after it. What it repeats: ``--decoder-layers-to-keep`` and the default
        ``--max-target-positions`` (lines 272-278), the input embedding (:meth:`build_lm_embedding`, lines
        280-302, through fairseq's ``build_embedding`` hook for the plain table), and the
        ``--tie-adaptive-weights`` checks (lines 304-312, here one error instead of asserts).
        """
        cfg, args = args, model_config.as_namespace(args, task)  # fairseq-hydra-train's DictConfig: a Namespace
        distributed.check_ddp_backend(args)
        spec = resolve_lm_args(args)
        if args.decoder_layers_to_keep:
            args.decoder_layers = len(args.decoder_layers_to_keep.split(","))
        if getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = getattr(args, "tokens_per_sample", DEFAULT_MAX_TARGET_POSITIONS)
        if args.tie_adaptive_weights and not (
            args.adaptive_input
            and args.adaptive_input_factor == args.adaptive_softmax_factor
            and args.adaptive_softmax_cutoff == args.adaptive_input_cutoff
            and args.decoder_input_dim == args.decoder_output_dim
        ):
            raise DeepInitConfigError(
                "--tie-adaptive-weights needs --adaptive-input with the same factor and cutoff as the adaptive "
                "softmax, and --decoder-input-dim equal to --decoder-output-dim"
            )
        with plan.carried(args, spec):
            model = cls(cls.build_decoder(args, task.target_dictionary, cls.build_lm_embedding(args, task)))
        model.decoder.set_target_padding(target_padding(task))
        model.args = args  # as fairseq's TransformerModel keeps them (Admin's task and export read them)
        plan.apply_init(model, spec)
        model.spec = spec
        model_config.keep_resolved(cfg, args)
        logger.info(resolve.describe(spec))
        return model

    @classmethod
    def build_lm_embedding(cls, args, task):
        """The input embedding, as fairseq's ``transformer_lm`` builds it (character, adaptive or a table)."""
        if args.character_embeddings:
            return CharacterTokenEmbedder(
                task.source_dictionary,
                eval(args.character_filters),  # as fairseq's transformer_lm.py does
                args.character_embedding_dim,
                args.decoder_embed_dim,
                args.char_embedder_highway_layers,
            )
        if args.adaptive_input:
            return AdaptiveInput(
                len(task.source_dictionary),
                task.source_dictionary.pad(),
                args.decoder_input_dim,
                args.adaptive_input_factor,
                args.decoder_embed_dim,
                fairseq_options.eval_str_list(args.adaptive_input_cutoff, type=int),
                args.quant_noise_pq,
                args.quant_noise_pq_block_size,
            )
        return cls.build_embedding(args, task.source_dictionary, args.decoder_input_dim)

    @classmethod
    def build_embedding(cls, args, dictionary, embed_dim, path=None):
        embedding = plan.build_embedding(plan.spec_of(args), dictionary, embed_dim, path)
        return embedding if embedding is not None else super().build_embedding(args, dictionary, embed_dim, path)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens) -> DeepInitDecoder:
        """The plugin's decoder (its layers and output projection carry the axes), without cross-attention."""
        return DeepInitDecoder(TransformerConfig.from_namespace(args), tgt_dict, embed_tokens, no_encoder_attn=True)


model_config.register(MODEL_NAME, model_config.DeepInitLMConfig)  # fairseq-hydra-train (model_config.py)
