"""Value residual learning, ResFormer (Zhou et al. 2024, "Value Residual Learning For Alleviating Attention
Concentration In Transformers", arXiv 2410.17897): ``--value-residual``, each later layer's self-attention
values mixed with the first layer's,

    V_1 = x_1 W_v^1 + b_v^1,     V_l' = lam V_1 + (1 - lam) (x_l W_v^l + b_v^l)   (l = 2..L),

``x_l`` the self-attention's (normalised) input; ``lam = --value-residual-lambda`` (0.5, fixed, as released:
Zcchill/Value-Residual-Learning @ 95652f6 ``src/modeling/modeling_llama_resformer.py:375-381``), or with
``--value-residual-learned`` per token and head ``lam = 1 - sigmoid(x_l W_m + b_m)`` (lucidrains/x-transformers
@ 9252ed7 ``x_transformers.py:2079-2085, 2296-2302``, ``v1.lerp(v, mix)``). The mix is on the projected values
before the head split and the key/value cache, so the cache holds mixed values (``400-403``) and step-by-step
decoding needs layer 1's values of the current step only.

Encoder-decoder (this project's extension): per stack, on self-attention: encoder layers 2..L mix with
encoder layer 1's values, decoder layers 2..L with decoder layer 1's. Cross-attention is not mixed: every
layer's cross-attention values are projections of the same encoder output, so a mix is only a
reparametrisation of one projection (docs/schemes.md). The block: :mod:`fairseq_deepinit.modules.attention_features`.
"""

from __future__ import annotations

import math

from ..errors import DeepInitConfigError
from ..modules.attention_features import FirstValues, ValueMix, feature_attention
from .exporting import never
from .record import FLAG, Method, Option, Rule, own_attention_forward, standard_layer

DEFAULT_LAMBDA = 0.5


def _lambda_problem(value) -> str | None:
    if isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= 1:
        return None
    return f"--value-residual-lambda must be a number in [0, 1] (default {DEFAULT_LAMBDA}), got {value}"


OPTIONS = (
    Option(
        "value_residual",
        bool,
        False,
        "value residual (ResFormer): each later layer's self-attention values mixed with the first layer's "
        "(Zhou et al. 2024; docs/schemes.md)",
    ),
    Option(
        "value_residual_lambda",
        float,
        DEFAULT_LAMBDA,
        f"with --value-residual: the first layer's share lam in lam V_1 + (1 - lam) V_l (default {DEFAULT_LAMBDA}, "
        "the release's)",
        check=_lambda_problem,
    ),
    Option(
        "value_residual_learned",
        bool,
        False,
        "with --value-residual: learn the mix per token and head, sigmoid(Linear(d, heads)) (x-transformers) "
        "instead of the fixed lambda",
    ),
)


def validate_value_residual(p, spec) -> None:
    if p.value_residual_learned and p.value_residual_lambda != DEFAULT_LAMBDA:
        raise DeepInitConfigError(
            "--value-residual-lambda sets the fixed mix and --value-residual-learned learns it; drop one of them"
        )


def setup_value_residual_stack(stack, p, spec, stack_spec) -> None:
    """Stack set-up: the first layer's self-attention records ``V_1``, every later one mixes with it."""
    source = FirstValues()
    for i, layer in enumerate(stack.layers):
        attn = feature_attention(layer.self_attn)
        if i == 0:
            attn.value_source = source
        else:
            attn.value_mix = ValueMix(
                source, p.value_residual_lambda, p.value_residual_learned, attn.embed_dim, attn.num_heads
            ).to(attn.q_proj.weight.device)


def describe_value_residual(p) -> str:
    return "value-residual=" + ("learned" if p.value_residual_learned else f"{p.value_residual_lambda:g}")


METHOD = Method(
    name="value_residual",
    title="Value residual (ResFormer)",
    paper="Zhou et al. 2024 (arXiv 2410.17897), ResFormer; x-transformers learned_value_residual_mix",
    summary="layers 2..L of each stack attend with lam V_1 + (1 - lam) V_l on self-attention (lam 0.5 fixed, or "
    "learned per token and head); the cache holds mixed values",
    code="Zcchill/Value-Residual-Learning @ 95652f6 src/modeling/modeling_llama_resformer.py:375-381,400-403,"
    "876-887; lucidrains/x-transformers @ 9252ed7 x_transformers/x_transformers.py:2079-2085,2296-2302",
    enabled_by="value_residual",
    options=OPTIONS,
    requires=(standard_layer("mixes the standard layer's self-attention values (MAtt's decoder has none)"),),
    excludes=(
        *own_attention_forward("a value mix"),
        Rule(
            FLAG,
            ("encoder_layerdrop", "decoder_layerdrop", "encoder_layers_to_keep", "decoder_layers_to_keep"),
            "every later layer reads the first layer's values of the same forward, which a dropped layer 1 lacks",
        ),
        Rule(
            FLAG,
            ("checkpoint_activations",),
            "a recomputed layer would read the first layer's values of the forward without their gradient",
        ),
    ),
    validate=validate_value_residual,
    describe=describe_value_residual,
    export=never(
        "--value-residual mixes every later layer's attention values with the first layer's, a path neither target has"
    ),
    stack_setup=setup_value_residual_stack,
    families={
        "valueres": dict(init_scheme="xavier", value_residual=True, norm_placement="pre"),
    },
)
