"""``--to huggingface``: the stock fairseq model (:mod:`.fold`, :mod:`.to_fairseq`) as one of the three classes of
Hugging Face ``transformers`` that are fairseq's own computations, with its config and generation config.

- ``FSMTForConditionalGeneration``: fairseq's Post-LN ``transformer`` (transformers' ``models/fsmt/modeling_fsmt.py``:
  ``EncoderLayer`` / ``DecoderLayer`` normalise after each residual sum; positions are an ``nn.Embedding`` holding
  fairseq's sinusoidal table, ``SinusoidalPositionalEmbedding``, so a learned or folded table loads as well);
  separate source and target vocabularies.
- ``M2M100ForConditionalGeneration``: fairseq's Pre-LN ``transformer`` with the stacks' final norms
  (``models/m2m_100/modeling_m2m_100.py``: ``M2M100EncoderLayer`` normalises each branch's input, ``layer_norm``
  after the last layer; fairseq's sinusoidal positions with their padding offset, a buffer computed at load); one
  vocabulary size for both stacks.
- ``XGLMForCausalLM``: fairseq's Pre-LN ``transformer_lm`` (``models/xglm/modeling_xglm.py``).

Which class, if any, is decided by :func:`fairseq_deepinit.export.route.classify` from the spec (the route's
``hf_class``); what only the built stock model shows (a folded position table, the vocabulary sizes, a missing
final norm) is checked here, each refusal one line. The mapping reads the stock fairseq model's modules, so
every dimension is the one fairseq built. Nothing here imports ``transformers`` at module level: the package is
needed only for ``--to huggingface``.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from ..errors import ExportError
from .scoring import compare_log_probs, plugin_scores, random_sentences

FSMT, M2M100, XGLM = "FSMT", "M2M100", "XGLM"
#: the transformers class of each, and the auto class that loads it
CLASSES = {
    FSMT: ("FSMTForConditionalGeneration", "FSMTConfig", "AutoModelForSeq2SeqLM"),
    M2M100: ("M2M100ForConditionalGeneration", "M2M100Config", "AutoModelForSeq2SeqLM"),
    XGLM: ("XGLMForCausalLM", "XGLMConfig", "AutoModelForCausalLM"),
}
#: fairseq's --activation-fn as transformers' ACT2FN names the same function (fairseq/utils.py get_activation_fn;
#: transformers/activations.py: ``gelu_new`` is fairseq's ``gelu_accurate`` tanh form, ``gelu_fast`` its old name)
HF_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_accurate": "gelu_new",
    "gelu_fast": "gelu_new",
    "tanh": "tanh",
    "linear": "linear",
}
TRANSFORMERS_PIN = "transformers==5.23.0"


def require_transformers() -> None:
    """One line naming the pin when ``transformers`` is absent; its progress bars off (the export logs one line)."""
    try:
        import transformers
    except ImportError as e:
        raise ExportError(
            f"--to huggingface needs the transformers package: pip install {TRANSFORMERS_PIN} "
            "(requirements/huggingface.txt; bash scripts/setup.sh installs it)"
        ) from e
    transformers.utils.logging.disable_progress_bar()


def _positions(stack, pad: int) -> Tuple[torch.Tensor | None, int]:
    """``(table, positions)``: the position table fairseq's ``stack`` adds (a learned or folded table as stored; the
    sinusoidal one computed as fairseq computes it) and the positions it covers."""
    from fairseq.modules import SinusoidalPositionalEmbedding

    emb = stack.embed_positions
    if emb is None:
        raise ExportError("the model adds no positions; transformers' classes always add them")
    if isinstance(emb, SinusoidalPositionalEmbedding):
        n = stack.max_positions() + pad + 1
        return SinusoidalPositionalEmbedding.get_embedding(n, emb.embedding_dim, pad), stack.max_positions()
    return emb.weight.detach(), emb.weight.size(0) - pad - 1


def _stacks_fit(stock, pre: bool) -> None:
    """The stock model's stacks have what the class has (the placement itself is the route's, from the spec): no
    embedding norm, a final norm after a Pre-LN stack, no projections around the decoder."""
    stacks = [s for s in (getattr(stock, "encoder", None), stock.decoder) if s is not None]
    for stack in stacks:
        if getattr(stack, "layernorm_embedding", None) is not None:
            raise ExportError("--layernorm-embedding: transformers' FSMT, M2M100 and XGLM have no embedding norm")
        if pre and getattr(stack, "layer_norm", None) is None:
            raise ExportError(
                "a Pre-LN stack without its final norm (--no-decoder-final-norm); M2M100 and XGLM end each stack in one"
            )
    if getattr(stock.decoder, "project_in_dim", None) is not None or stock.decoder.project_out_dim is not None:
        raise ExportError("--decoder-input-dim / --decoder-output-dim: transformers' classes have no projections there")


def _layers(stack, out_prefix: str, sd: Dict[str, torch.Tensor], in_prefix: str, full: dict) -> None:
    """The layers of ``stack``: fairseq's and transformers' names agree below ``layers.<i>.`` (q/k/v/out_proj,
    the three sub-layer norms, fc1, fc2), only the prefix changes."""
    for key, value in full.items():
        if key.startswith(f"{in_prefix}layers.") or key.startswith(f"{in_prefix}layer_norm."):
            sd[out_prefix + key[len(in_prefix) :]] = value


def _plain(stock) -> dict:
    """The stock model's weights in float32 under every name (a tied embedding under each of its names; fairseq's
    ``version`` and ``_float_tensor`` buffers dropped)."""
    return {
        k: v.detach().to(torch.float32).clone()
        for k, v in stock.state_dict().items()
        if v.is_floating_point() and not k.endswith("_float_tensor")
    }


def dropouts(stock_args: dict) -> dict:
    """The training's dropout rates under transformers' names (for fine-tuning; evaluation ignores them)."""
    return {
        "dropout": float(stock_args.get("dropout") or 0.0),
        "attention_dropout": float(stock_args.get("attention_dropout") or 0.0),
        "activation_dropout": float(stock_args.get("activation_dropout") or 0.0),
    }


#: fairseq-generate's defaults: --beam 5 --lenpen 1 --max-len-a 0 --max-len-b 200 --min-len 1
#: (fairseq/dataclass/configs.py GenerationConfig)
BEAM, LENPEN, MAX_LEN_B = 5, 1.0, 200


def generation_config(model, stock_args: dict):
    """fairseq-generate's default search as transformers' ``GenerationConfig``: beam 5 finishing when 5 hypotheses
    have ended (``early_stopping=True``), scores divided by length^1, at most 200 words then ``</s>`` (fewer where
    the model covers fewer positions), ``</s>`` never first (``min_new_tokens=1``: fairseq's ``--min-len 1``
    masks it after the log-softmax, as transformers' logits processors do; after a language model's prompt fairseq
    allows it at once, so no minimum there)."""
    import transformers

    c = model.config
    positions = int(stock_args.get("max_target_positions") or 1024)
    return transformers.GenerationConfig(
        num_beams=BEAM,
        early_stopping=True,
        length_penalty=LENPEN,
        max_length=min(MAX_LEN_B, positions - 1) + 1,
        min_new_tokens=1 if c.is_encoder_decoder else 0,
        bos_token_id=c.bos_token_id,
        pad_token_id=c.pad_token_id,
        eos_token_id=c.eos_token_id,
        decoder_start_token_id=c.decoder_start_token_id if c.is_encoder_decoder else None,
        forced_eos_token_id=c.eos_token_id,
    )


def hf_model(kind: str, stock, stock_args: dict, dicts: List, dropout: dict, langs: List[str]):
    """The transformers model of ``kind`` holding the stock fairseq model ``stock`` (float32), its state loaded
    strictly (every key of the class given, none left over). ``dicts``: the model's fairseq dictionaries (source,
    target; one for a language model); ``stock_args``: its stock arguments (the activation); ``langs``: the
    source and target language codes (FSMT's config names them)."""
    import transformers

    act = stock_args.get("activation_fn") or "relu"
    if act not in HF_ACTIVATIONS:
        raise ExportError(f"--activation-fn {act}: transformers' classes compute {', '.join(HF_ACTIVATIONS)}")
    full = _plain(stock)
    tgt = dicts[-1]
    dec = stock.decoder
    d = dec.embed_tokens.embedding_dim
    special = dict(
        pad_token_id=tgt.pad(), bos_token_id=tgt.bos(), eos_token_id=tgt.eos(), decoder_start_token_id=tgt.eos()
    )
    pre = kind != FSMT
    _stacks_fit(stock, pre)
    dec_pos, dec_n = _positions(dec, tgt.pad())
    common = dict(
        d_model=d,
        activation_function=HF_ACTIVATIONS[act],
        scale_embedding=float(dec.embed_scale) != 1.0,
        **dropout,
        **special,
    )
    sd: Dict[str, torch.Tensor] = {}
    if kind == XGLM:
        tied = dec.share_input_output_embed
        config = transformers.XGLMConfig(
            vocab_size=len(tgt),
            max_position_embeddings=dec_n,
            ffn_dim=dec.layers[0].fc1.out_features,
            num_layers=len(dec.layers),
            attention_heads=dec.layers[0].self_attn.num_heads,
            tie_word_embeddings=tied,
            layerdrop=0.0,
            **common,
        )
        _check_positions(dec, dec_pos, "decoder")
        sd["model.embed_tokens.weight"] = full["decoder.embed_tokens.weight"]
        _layers(dec, "model.", sd, "decoder.", full)
        sd["lm_head.weight"] = full.get("decoder.output_projection.weight", full["decoder.embed_tokens.weight"])
    else:
        enc = stock.encoder
        src = dicts[0]
        enc_pos, enc_n = _positions(enc, src.pad())
        if enc.embed_tokens.embedding_dim != d:
            raise ExportError("the encoder and decoder widths differ; transformers' classes have one d_model")
        emb = {s: full[f"{s}.embed_tokens.weight"] for s in ("encoder", "decoder")}
        out = full.get("decoder.output_projection.weight", emb["decoder"])
        all_tied = torch.equal(emb["encoder"], emb["decoder"]) and torch.equal(out, emb["decoder"])
        sizes = dict(
            encoder_layers=len(enc.layers),
            decoder_layers=len(dec.layers),
            encoder_attention_heads=enc.layers[0].self_attn.num_heads,
            decoder_attention_heads=dec.layers[0].self_attn.num_heads,
            encoder_ffn_dim=enc.layers[0].fc1.out_features,
            decoder_ffn_dim=dec.layers[0].fc1.out_features,
            encoder_layerdrop=0.0,
            decoder_layerdrop=0.0,
        )
        _layers(enc, "model.encoder.", sd, "encoder.", full)
        _layers(dec, "model.decoder.", sd, "decoder.", full)
        if kind == FSMT:
            if enc_pos.shape != dec_pos.shape:
                raise ExportError(
                    f"the encoder covers {enc_n} positions and the decoder {dec_n}; FSMT has one "
                    "max_position_embeddings (train with equal --max-source-positions and --max-target-positions)"
                )
            config = transformers.FSMTConfig(
                langs=list(langs),
                src_vocab_size=len(src),
                tgt_vocab_size=len(tgt),
                max_position_embeddings=dec_n,
                tie_word_embeddings=all_tied,
                **sizes,
                **common,
            )
            for stack, table in (("encoder", enc_pos), ("decoder", dec_pos)):
                sd[f"model.{stack}.embed_tokens.weight"] = emb[stack]
                sd[f"model.{stack}.embed_positions.weight"] = table.to(torch.float32)
            sd["model.decoder.output_projection.weight"] = out
        else:
            if len(src) != len(tgt):
                raise ExportError(
                    f"the source dictionary has {len(src)} entries and the target {len(tgt)}; M2M100 has one "
                    "vocabulary size (train with --joined-dictionary, or use --to ctranslate2)"
                )
            _check_positions(enc, enc_pos, "encoder")
            _check_positions(dec, dec_pos, "decoder")
            config = transformers.M2M100Config(
                vocab_size=len(tgt),
                max_position_embeddings=max(enc_n, dec_n),
                tie_word_embeddings=all_tied,
                **sizes,
                **common,
            )
            sd["model.shared.weight"] = emb["encoder"]
            sd["model.encoder.embed_tokens.weight"] = emb["encoder"]
            sd["model.decoder.embed_tokens.weight"] = emb["decoder"]
            sd["lm_head.weight"] = out
    model = getattr(transformers, CLASSES[kind][0])(config)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("embed_positions.weights")]  # M2M100/XGLM's computed buffer
    if missing or unexpected:
        raise ExportError(
            f"the {kind} state does not match transformers' class: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return model.eval()


def _check_positions(stack, table: torch.Tensor, name: str) -> None:
    """M2M100 and XGLM compute fairseq's sinusoidal table themselves: a learned or folded one cannot go there."""
    from fairseq.modules import SinusoidalPositionalEmbedding

    if not isinstance(stack.embed_positions, SinusoidalPositionalEmbedding):
        raise ExportError(
            f"the {name}'s positions are a learned table (--{name}-learned-pos, or a fold scaled them); transformers' "
            "M2M100 and XGLM compute sinusoidal positions only"
        )


def hf_scores(model, sentences) -> List[torch.Tensor]:
    """The transformers model's log-probabilities (float64) of the same tokens :func:`.scoring.plugin_scores`
    scores: teacher-forced, each sentence alone, ``use_cache=False`` (FSMT applies its causal mask only then)."""
    eos = model.config.eos_token_id
    out = []
    with torch.no_grad():
        for src, tgt in sentences:
            if not model.config.is_encoder_decoder:
                tokens = torch.tensor([[eos, *tgt]])
                logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
                gold = tokens[:, 1:]
            else:
                source = torch.tensor([[*src, eos]])
                logits = model(
                    input_ids=source,
                    attention_mask=torch.ones_like(source),
                    decoder_input_ids=torch.tensor([[model.config.decoder_start_token_id, *tgt]]),
                    use_cache=False,
                ).logits
                gold = torch.tensor([[*tgt, eos]])
            lp = torch.log_softmax(logits.to(torch.float64), -1)
            out.append(lp.gather(-1, gold[..., None])[0, :, 0])
    return out


def load_hf(folder: str, lm: bool):
    """The model in ``folder`` as a user loads it (the auto class), float32, eval."""
    import transformers

    auto = transformers.AutoModelForCausalLM if lm else transformers.AutoModelForSeq2SeqLM
    return auto.from_pretrained(folder, dtype=torch.float32).eval()


def check_hf_dir(folder: str, plugin_model, tolerance: float) -> float:
    """Reload ``folder`` with transformers' auto class and compare its teacher-forced log-probabilities with the
    plugin model's on random sentences (:func:`.scoring.compare_log_probs`); the largest difference."""
    lm = getattr(plugin_model, "encoder", None) is None
    sentences = random_sentences(plugin_model)
    hf = hf_scores(load_hf(folder, lm), sentences)
    return compare_log_probs(plugin_scores(plugin_model, sentences), hf, tolerance, "the transformers model")


__all__ = [
    "CLASSES",
    "FSMT",
    "HF_ACTIVATIONS",
    "M2M100",
    "XGLM",
    "check_hf_dir",
    "dropouts",
    "generation_config",
    "hf_model",
    "hf_scores",
    "load_hf",
]
