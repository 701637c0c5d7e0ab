"""Output logit soft-capping (Gemma 2, Gemma Team 2024, arXiv 2408.00118, sec. 2 "Logit soft-capping"):
``--output-softcap``, the decoder's output logits squashed into ``(-c, c)`` before the log-softmax,

    z = c * tanh(W_out h / c),     log p(y | ...) = log_softmax(z)_y,

``c`` = ``--output-softcap-value`` (30, Gemma 2's ``final_logit_softcap``). Released code: google-deepmind/gemma
@ 7691fd4 ``gemma/gm/nn/_transformer.py:268-270`` (``logits /= cap``, ``tanh(logits) * cap``) and
``gemma/gm/nn/_gemma.py:59`` (``final_logit_softcap=30.0``); HF transformers ``Gemma2ForCausalLM.forward``
(``final_logit_softcapping``).

The cap sits in the decoder's output layer (:meth:`fairseq_deepinit.decoder.DeepInitDecoder.output_layer`, after
the output projection, FixNorm's included), so every reader of the logits gets the capped ones: the criterion's
``get_normalized_probs`` in training (and a loss term such as z-loss), fairseq's ``SequenceGenerator`` and
``fairseq-eval-lm`` in decoding. Computed in float32 and rounded once to the logits' dtype.
"""

from __future__ import annotations

from .exporting import FAIRSEQ, Export
from .record import FLAG, Method, Option, Rule, positive

DEFAULT_CAP = 30.0  # Gemma 2: final_logit_softcap=30.0 (gemma/gm/nn/_gemma.py:59)

OPTIONS = (
    Option(
        "output_softcap",
        bool,
        False,
        "output logit soft-capping: the decoder's output logits z become c*tanh(z/c) before the log-softmax, in "
        "training and decoding (Gemma 2; docs/schemes.md)",
    ),
    Option(
        "output_softcap_value",
        float,
        DEFAULT_CAP,
        f"with --output-softcap: the cap c (default {DEFAULT_CAP:g}, Gemma 2's final_logit_softcap)",
        metavar="C",
        check=positive("output_softcap_value"),
    ),
)


def setup_output_softcap(stack, p, spec, stack_spec) -> None:
    """Stack set-up: the decoder's output layer caps its logits."""
    if stack_spec.kind.stack == "decoder":
        stack.final_logit_cap = float(p.output_softcap_value)


METHOD = Method(
    name="output_softcap",
    title="Output logit soft-capping",
    paper="Gemma Team 2024 (Gemma 2, arXiv 2408.00118), sec. 2 logit soft-capping",
    summary="the decoder's output logits z become c tanh(z / c) (c 30) before the log-softmax, in training and "
    "decoding, in float32",
    code="google-deepmind/gemma @ 7691fd4 gemma/gm/nn/_transformer.py:268-270, gemma/gm/nn/_gemma.py:59",
    enabled_by="output_softcap",
    options=OPTIONS,
    excludes=(
        Rule(FLAG, ("adaptive_softmax_cutoff",), "adaptive softmax never forms the full logits the cap acts on"),
    ),
    describe=lambda p: f"output-softcap={p.output_softcap_value:g}",
    stack_setup=setup_output_softcap,
    families={"outsoftcap": dict(init_scheme="xavier", output_softcap=True, norm_placement="pre")},
    # CTranslate2 4.8 carries it: the decoder spec's final_logit_softcapping (specs/transformer_spec.py:276), set by
    # fairseq_deepinit.export.to_ct2
    export=Export(
        refuses={
            FAIRSEQ: "--output-softcap squashes the output logits by c*tanh(z/c), which a stock transformer does not",
        }
    ),
)
