"""fairseq's own model options that the export reads: one typed view of a checkpoint's model arguments.

:class:`FairseqArgs` is built once per checkpoint (:meth:`FairseqArgs.of`) from its flat model arguments; the
route (:mod:`.route`) and Admin's omega fold (:mod:`.omega`) read its fields. The plugin's options are not here:
they are read from the resolved :class:`~fairseq_deepinit.spec.ModelSpec`.

Each field's default is fairseq 0.12.3's, used where the checkpoint's arguments lack the option (an older
checkpoint, a language model lacking a translation option): ``fairseq/models/transformer/transformer_config.py``
(``TransformerConfig`` and its ``EncDecBaseConfig`` / ``DecoderConfig``) and, for the language model's own
options, ``fairseq/models/transformer_lm.py`` (``TransformerLanguageModelConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class FairseqArgs:
    """fairseq's model options the export reads, with fairseq's defaults (source lines in each comment)."""

    activation_fn: str = "relu"  # transformer_config.py:98 (None: relu, as fairseq's get_activation_fn reads it)
    cross_self_attention: bool = False  # transformer_config.py:196
    adaptive_input: bool = False  # transformer_config.py:113, transformer_lm.py:108
    adaptive_softmax_cutoff: Any | None = None  # transformer_config.py:149 (a list), transformer_lm.py:68 (a str)
    character_embeddings: bool = False  # transformer_lm.py:91
    encoder_layers_to_keep: Any | None = None  # transformer_config.py:48 (EncDecBaseConfig.layers_to_keep)
    decoder_layers_to_keep: Any | None = None  # transformer_config.py:48
    no_token_positional_embeddings: bool = False  # transformer_config.py:143
    decoder_input_dim: int | None = None  # transformer_config.py:62 (None: --decoder-embed-dim)
    decoder_output_dim: int | None = None  # transformer_config.py:63 (None: --decoder-embed-dim)
    layernorm_embedding: bool = False  # transformer_config.py:162
    share_all_embeddings: bool = False  # transformer_config.py:129 (a translation option: absent for a language model)
    encoder_learned_pos: bool = False  # transformer_config.py:43 (EncDecBaseConfig.learned_pos)
    decoder_learned_pos: bool = False  # transformer_config.py:43

    @classmethod
    def of(cls, args: Any) -> FairseqArgs:
        """The options of ``args`` (a checkpoint's flat model arguments); one it lacks has fairseq's default."""
        values = {f.name: getattr(args, f.name, f.default) for f in fields(cls)}
        values["activation_fn"] = values["activation_fn"] or "relu"
        return cls(**values)

    def learned_pos(self, stack: str) -> bool:
        """``--encoder-learned-pos`` / ``--decoder-learned-pos`` of ``stack`` (``encoder`` or ``decoder``)."""
        return self.encoder_learned_pos if stack == "encoder" else self.decoder_learned_pos
