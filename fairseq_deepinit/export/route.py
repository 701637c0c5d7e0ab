"""Which way out a checkpoint has: the one classification of a model for ``deepinit-export``.

:func:`classify` reads the resolved model arguments (what :func:`fairseq_deepinit.options.resolve_and_validate`
stored: placement per stack, norm type and eps, residual scaling, init scheme, layer type, features) and
returns a :class:`Route`: for each target, whether the model is exactly a stock fairseq ``transformer`` /
``transformer_lm`` (``stock``), becomes one by folding constants into its weights (``fold``), is exactly
expressible in CTranslate2's ``TransformerSpec`` only, or is refused, with one line naming the feature and
why. Nothing else in the export decides a route; the folds (:mod:`.fold`) and the writers
(:mod:`.to_fairseq`, :mod:`.to_ct2`) only carry out the plan it returns. docs/export.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Tuple

from .. import options
from ..errors import ExportError

FAIRSEQ = "fairseq"
CTRANSLATE2 = "ctranslate2"
TARGETS = (FAIRSEQ, CTRANSLATE2)

#: fairseq's LayerNorm eps (fairseq/modules/layer_norm.py: ``eps=1e-5``), which a stock transformer cannot change
FAIRSEQ_LN_EPS = 1e-5
#: CTranslate2's norm eps when ``layer_norm_epsilon`` is not set: 1e-5 for LayerNorm, 1e-6 for RMSNorm
#: (src/layers/common.cc:445-453)
CT2_DEFAULT_EPS = {"layernorm": 1e-5, "rmsnorm": 1e-6}
#: an RMSNorm that is the identity: ``x * rsqrt(mean(x^2) + 2^100) * 2^50 = x`` exactly while
#: ``mean(x^2) < 2^76`` (the eps absorbs it in fp32) and ``|x| > 2^-76`` (no subnormal); powers of two
#: make the product of the two scales exactly 1
IDENTITY_EPS = 2.0**100
IDENTITY_GAIN = 2.0**50

#: CTranslate2's activations for fairseq's --activation-fn (its converter, converters/fairseq.py:19-25)
CT2_ACTIVATIONS = {
    "relu": "RELU",
    "gelu": "GELU",
    "gelu_accurate": "GELUTanh",
    "gelu_fast": "GELUTanh",
    "swish": "SWISH",
}

#: the plugin's options the route decides on, or that change nothing an export carries (the init schemes' and the
#: profiling's, read before training only); another method's option, with a value other than its default, is
#: refused until this list and :func:`classify` say what it does (:func:`_unknown`)
UNDERSTOOD = frozenset(
    {
        *("init_scheme", "norm_type", "norm_eps", "residual_scale", "decoder_layer_type", "force_norm_with_scheme"),
        *("attention_impl", "lipschitz_bias_free", "ds_init_variant", "ds_init_alpha", "fixnorm", "deepnorm_variant"),
        *("admin_formula", "admin_output_change", "admin_freeze_omega", "admin_profile_batches"),
        *("admin_profile_max_tokens", "admin_profile_path", "admin_profile_only", "matt_self_branch", "matt_share_v"),
        *("b2t_init_rescale", "resi_dual_scale", "resi_dual_alpha", "resi_dual_start", "resi_dual_final_eps"),
        *("hyper_connections", "hc_streams", "hc_dynamic", "mhc_sinkhorn_iters", "mhc_gating_init", "mhc_eps"),
        *("scale_attn", "scale_fc", "scale_heads", "scale_resids", "subln", "layernorm_scaling", "mix_ln"),
        *("mixln_ratio", "mixln_post_layers", "norm_placement", "qk_norm", "qk_norm_scope", "qk_norm_type"),
        *("qk_norm_eps", "qk_norm_cross", "dyt_alpha_init", "dyt_bias", "dyt_embed_scale", "derf_alpha_init"),
        *("derf_bias", "derf_embed_scale", "derf_shift_init", "depth_mup", "depth_mup_alpha", "depth_mup_base_layers"),
        "depth_mup_source",
        *("gated_attention", "gated_attention_granularity", "gated_attention_cross", "attention_sinks"),
        *("attention_sinks_cross", "value_residual", "value_residual_lambda", "value_residual_learned"),
        *("z_loss", "z_loss_multiplier", "qk_clip", "qk_clip_threshold", "qk_clip_alpha", "qk_clip_cross"),
    }
)
#: the values of the selectors the route knows (folded, exact or refused with a reason)
KNOWN_RESIDUALS = ("none", "admin", "deepnorm", "rezero", "depth-mup", "b2t", "resi-dual", "hyper-connections")
KNOWN_NORMS = ("layernorm", "rmsnorm", "scalenorm", "none", "dyt", "derf")


def _unknown(args) -> str | None:
    """Why a model using something the route was not written for is refused (a method added since), or None."""
    for option, method in options.all_options():
        value = getattr(args, option.name, None)
        if option.name not in UNDERSTOOD and value not in (None, False) and value != option.default:
            owner = method.title if method is not None else "an axis of the model"
            return f"{option.flag} ({owner}): the export does not carry this option yet"
    if args.residual_scale not in KNOWN_RESIDUALS:
        return f"--residual-scale {args.residual_scale}: the export has no fold for this residual yet"
    if args.norm_type not in KNOWN_NORMS:
        return f"--norm-type {args.norm_type}: the export does not carry this norm yet"
    return None


#: features that neither target can carry, each with why (first match wins)
_NEVER = (
    (
        lambda a: a.decoder_layer_type != "standard",
        lambda a: (
            f"--decoder-layer-type {a.decoder_layer_type} (MAtt): its decoder layer merges an average-attention "
            "branch into the cross-attention through one W_o; a stock transformer and CTranslate2's TransformerSpec "
            "have separate self- and cross-attention sub-layers"
        ),
    ),
    (
        lambda a: a.residual_scale == "b2t",
        lambda a: (
            "--residual-scale b2t adds each layer's input before its last norm, a third residual path neither "
            "target has"
        ),
    ),
    (
        lambda a: a.residual_scale == "hyper-connections",
        lambda a: (
            f"--hyper-connections {a.hyper_connections} carries {a.hc_streams} residual streams per token, mixed by "
            "learned weights around every sub-layer; neither target has more than one residual stream"
        ),
    ),
    (
        lambda a: a.residual_scale == "resi-dual",
        lambda a: (
            "--residual-scale resi-dual carries a second, un-normalised stream through every layer, which "
            "neither target has"
        ),
    ),
    (
        lambda a: any(getattr(a, f, False) for f in ("scale_attn", "scale_fc", "scale_heads", "scale_resids")),
        lambda a: (
            "NormFormer (--scale-attn/--scale-fc/--scale-heads/--scale-resids) adds norms and scales inside the "
            "sub-layers, which neither target has"
        ),
    ),
    (
        lambda a: getattr(a, "subln", False),
        lambda a: "--subln (Sub-LN) puts a norm before each out_proj and fc2, which neither target has",
    ),
    (
        lambda a: getattr(a, "mix_ln", False),
        lambda a: "--mix-ln mixes Post-LN and Pre-LN layers in one stack; both targets have one placement per stack",
    ),
    (
        lambda a: getattr(a, "norm_placement", "auto") == "reordered",
        lambda a: (
            "--norm-placement reordered (OLMo 2) normalises each branch's output only, a placement neither target has"
        ),
    ),
    (
        lambda a: getattr(a, "gated_attention", False),
        lambda a: (
            "--gated-attention multiplies each head's attention output by a sigmoid gate before out_proj, which "
            "neither target has"
        ),
    ),
    (
        lambda a: getattr(a, "attention_sinks", False),
        lambda a: "--attention-sinks adds a learned logit to every softmax denominator, which neither target has",
    ),
    (
        lambda a: getattr(a, "value_residual", False),
        lambda a: (
            "--value-residual mixes every later layer's attention values with the first layer's, a path neither "
            "target has"
        ),
    ),
    (
        lambda a: a.norm_type in ("dyt", "derf"),
        lambda a: f"--norm-type {a.norm_type} is a point-wise tanh/erf in each norm's place, which neither target has",
    ),
    (
        lambda a: getattr(a, "cross_self_attention", False),
        lambda a: "--cross-self-attention attends over the encoder output and the prefix in one attention",
    ),
    (
        lambda a: getattr(a, "no_cross_attention", False) and getattr(a, "encoder_layers", None) != 0,
        lambda a: "--no-cross-attention: a translation model whose decoder ignores the encoder",
    ),
    (
        lambda a: (
            getattr(a, "adaptive_input", False)
            or getattr(a, "adaptive_softmax_cutoff", None)
            or getattr(a, "character_embeddings", False)
        ),
        lambda a: "adaptive input/softmax or character embeddings replace the embedding table and output layer",
    ),
    (
        lambda a: getattr(a, "encoder_layers_to_keep", None) or getattr(a, "decoder_layers_to_keep", None),
        lambda a: "--*-layers-to-keep prunes layers at load time; export the pruned model from a checkpoint of it",
    ),
)


@dataclass(frozen=True)
class QKNorm:
    """The q/k norms of the self-attentions (CTranslate2's per-head ``q_norm`` / ``k_norm``)."""

    kind: str  # "rmsnorm" or "layernorm" as CTranslate2 computes it (ScaleNorm is an RMSNorm, see eps)
    eps: float
    scalenorm: bool  # the plugin's ScaleNorm: weight g/sqrt(head_dim), eps eps^2/head_dim


@dataclass(frozen=True)
class Route:
    """What :func:`classify` found (see the module docstring).

    ``placements``: per stack, ``post``, ``pre`` or ``peri``; ``norm``: ``layernorm``, ``rmsnorm``,
    ``scalenorm`` or ``none`` (every norm of the model); ``folds``: the constants folded into weights, in
    order; ``reasons``: per target, why it is refused (absent: exportable); ``ct2_eps``: CTranslate2's
    ``layer_norm_epsilon`` (None: its defaults, 1e-5 LayerNorm and 1e-6 RMSNorm, serve every norm).
    """

    lm: bool
    placements: Dict[str, str]
    norm: str
    norm_eps: float | None
    residual: str
    layernorm_scaling: bool
    fixnorm: bool
    qk_norm: QKNorm | None
    activation: str
    folds: Tuple[str, ...]
    reasons: Dict[str, str] = field(default_factory=dict)
    ct2_eps: float | None = None

    @property
    def fairseq(self) -> str | None:
        """``stock``, ``fold`` or None (refused)."""
        if FAIRSEQ in self.reasons:
            return None
        return "fold" if self.folds else "stock"

    def check(self, target: str) -> None:
        """Raise the one-line :class:`~fairseq_deepinit.errors.ExportError` if ``target`` is refused (naming the
        other target where that one takes the model)."""
        if target in self.reasons:
            other = CTRANSLATE2 if target == FAIRSEQ else FAIRSEQ
            hint = f"; --to {other} exports it exactly" if other not in self.reasons else ""
            raise ExportError(f"cannot export to {target}: {self.reasons[target]}{hint}")

    def describe(self) -> str:
        """One line: the model as the export sees it, and what happens to it per target."""
        stacks = ", ".join(f"{s} {p}-norm" for s, p in self.placements.items())
        parts = [f"{'language model' if self.lm else 'translation model'}: {stacks}, norm {self.norm}"]
        if self.folds:
            parts.append("folded into the weights: " + ", ".join(self.folds))
        return "; ".join(parts)


def _folds(args) -> Tuple[str, ...]:
    out = []
    if args.fixnorm:
        out.append("FixNorm's unit-norm embedding rows")
    if args.residual_scale == "admin":
        out.append("Admin's omega (previous norm and next input projections)")
    elif args.residual_scale == "deepnorm":
        out.append("DeepNorm's alpha (as Admin's omega)")
    elif args.residual_scale == "rezero":
        out.append("ReZero's a (into out_proj and fc2)")
    elif args.residual_scale == "depth-mup":
        out.append("depth-muP's (L/L_base)^-alpha (into out_proj and fc2)")
    if getattr(args, "layernorm_scaling", False):
        out.append("LayerNorm Scaling's 1/sqrt(l) (into each pre-norm's gain and bias)")
    return tuple(out)


def _ct2_eps(args, norm: str, stacks, qk: QKNorm | None) -> Tuple[float | None, str | None]:
    """CTranslate2's one ``layer_norm_epsilon`` for every norm of the model, or why there is none."""
    wanted = set()  # (kind as CTranslate2 computes it, eps)
    dims = {int(args.decoder_embed_dim)} | ({int(args.encoder_embed_dim)} if "encoder" in stacks else set())
    if norm == "layernorm":
        wanted.add(("layernorm", float(args.norm_eps)))
    elif norm == "rmsnorm":
        wanted.add(("rmsnorm", float(args.norm_eps)))
    elif norm == "scalenorm":
        wanted |= {("rmsnorm", float(args.norm_eps) ** 2 / d) for d in dims}
    elif norm == "none":
        wanted.add(("rmsnorm", IDENTITY_EPS))
    if qk is not None:
        wanted.add((qk.kind, qk.eps))
    values = {eps for _kind, eps in wanted}
    if len(values) == 1:
        return values.pop(), None
    if all(eps == CT2_DEFAULT_EPS[kind] for kind, eps in wanted):
        return None, None  # LayerNorm 1e-5 with RMSNorm 1e-6: CTranslate2's own defaults
    listed = ", ".join(f"{kind} {eps:g}" for kind, eps in sorted(wanted))
    return None, (
        f"CTranslate2 gives every norm of a model one epsilon (layer_norm_epsilon, src/layers/common.cc:445-453) and "
        f"this model's norms use several ({listed})"
    )


def _qk_norm(args, stacks) -> Tuple[QKNorm | None, str | None]:
    if not getattr(args, "qk_norm", False):
        return None, None
    if args.qk_norm_cross and "encoder" in stacks:
        return None, (
            "--qk-norm on the cross-attention: CTranslate2 4.8 normalises cross-attention queries over d_model before "
            "the head split (src/layers/attention.cc:430-439), not per head as the plugin; train with "
            "--no-qk-norm-cross, or export to neither"
        )
    if args.qk_norm_scope != "head":
        return None, (
            "--qk-norm-scope proj: CTranslate2 normalises self-attention queries and keys per head "
            "(src/layers/attention.cc:514-517), not over the whole projection"
        )
    head_dims = {int(args.decoder_embed_dim) // int(args.decoder_attention_heads)}
    if "encoder" in stacks:
        head_dims.add(int(args.encoder_embed_dim) // int(args.encoder_attention_heads))
    if args.qk_norm_type == "scalenorm":
        if len(head_dims) != 1:
            return None, "--qk-norm-type scalenorm with two head sizes gives two epsilons (eps^2/head_dim)"
        return QKNorm("rmsnorm", float(args.qk_norm_eps) ** 2 / head_dims.pop(), True), None
    return QKNorm(args.qk_norm_type, float(args.qk_norm_eps), False), None


def classify(args) -> Route:
    """The :class:`Route` of a model from its resolved arguments (``encoder_layers == 0``: a language model).

    Refusals are decided per target, each the first that applies: a feature neither target has (MAtt, B2T,
    ResiDual, NormFormer, Sub-LN, Mix-LN, the reordered placement, DyT/Derf, ...), then what stock fairseq
    lacks (norms other than LayerNorm with eps 1e-5, Peri-LN's output norms, q/k norms, FixNorm's output bias),
    then what CTranslate2 lacks (cross-attention q/k norms, several norm epsilons, an activation or an option
    its spec has no field for).
    """
    lm = getattr(args, "encoder_layers", None) == 0
    stacks = ("decoder",) if lm else ("encoder", "decoder")
    never = _unknown(args) or next((why(args) for test, why in _NEVER if test(args)), None)
    placements = {s.kind.stack: s.placement for s in options.spec_of(args).stacks}
    norm = args.norm_type
    if norm == "none":
        placements = {s: "post" for s in stacks}  # without norms both placements are x + f(x)
    qk, qk_reason = _qk_norm(args, stacks)
    route = dict(
        lm=lm,
        placements=placements,
        norm=norm,
        norm_eps=args.norm_eps,
        residual=args.residual_scale,
        layernorm_scaling=bool(getattr(args, "layernorm_scaling", False)),
        fixnorm=bool(getattr(args, "fixnorm", False)),
        qk_norm=qk,
        activation=getattr(args, "activation_fn", "relu") or "relu",
        folds=_folds(args),
    )
    if never is not None:
        return Route(**route, reasons={FAIRSEQ: never, CTRANSLATE2: never})
    reasons = {}
    fairseq = _fairseq_reason(args, norm, placements)
    if fairseq:
        reasons[FAIRSEQ] = fairseq
    eps, eps_reason = _ct2_eps(args, norm, stacks, qk)
    ct2 = qk_reason or eps_reason or _ct2_reason(args)
    if ct2:
        reasons[CTRANSLATE2] = ct2
    return Route(**route, reasons=reasons, ct2_eps=eps)


def _fairseq_reason(args, norm: str, placements: Dict[str, str]) -> str | None:
    if norm != "layernorm":
        what = "no norm at all" if norm == "none" else f"--norm-type {norm}"
        return f"{what}: a stock fairseq transformer has LayerNorms"
    if float(args.norm_eps) != FAIRSEQ_LN_EPS:
        return f"--norm-eps {args.norm_eps:g}: fairseq's LayerNorm has eps 1e-5 and no option to change it"
    if "peri" in placements.values():
        return "--norm-placement peri (Peri-LN): a stock transformer has no norm on a sub-layer's output"
    if getattr(args, "qk_norm", False):
        return "--qk-norm: a stock transformer has no q/k norms"
    if getattr(args, "fixnorm", False):
        return "--fixnorm: its output layer adds a per-word bias, which a stock transformer's output projection lacks"
    return None


def _ct2_reason(args) -> str | None:
    act = getattr(args, "activation_fn", "relu") or "relu"
    if act not in CT2_ACTIVATIONS:
        return f"--activation-fn {act}: CTranslate2's fairseq activations are {', '.join(CT2_ACTIVATIONS)}"
    if getattr(args, "no_token_positional_embeddings", False):
        return "--no-token-positional-embeddings: CTranslate2 adds sinusoidal positions when a model has none"
    dec = int(args.decoder_embed_dim)
    ins = int(getattr(args, "decoder_input_dim", None) or dec)
    outs = int(getattr(args, "decoder_output_dim", None) or dec)
    if (ins != dec) != (outs != dec):
        return (
            "only one of --decoder-input-dim / --decoder-output-dim differs from --decoder-embed-dim; CTranslate2's "
            "project_in_out has both projections or neither"
        )
    return None
