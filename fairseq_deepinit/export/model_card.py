"""The model card (``README.md``) of a ``--to huggingface`` folder, and the fairseq dictionaries beside it.

The card says what the model is (family, the methods and their papers from the records, transformers' class and
sizes), where it comes from (the checkpoint, its updates, the training options and data folder it stored, what
the export folded and how close the check found it), and how to load it and decode with it: through the
tokenizer where the folder has one, else with the fairseq dictionary's ids (``dict.*.txt`` are copied beside).
Nothing is uploaded; the front matter is the hub's metadata.
"""

from __future__ import annotations

import os
import shutil
from typing import List, Sequence

from ..methods import INIT_SCHEMES, LAYER_TYPES, METHODS, RESIDUAL_SCALINGS, declaring
from ..spec import ModelSpec

#: the training options the card lists, when the checkpoint stored them (fairseq's option names)
TRAINING_OPTIONS = (
    "optimizer",
    "lr",
    "lr_scheduler",
    "warmup_updates",
    "max_update",
    "max_tokens",
    "batch_size",
    "update_freq",
    "criterion",
    "label_smoothing",
    "dropout",
    "weight_decay",
    "clip_norm",
    "seed",
)


PLACEMENT = {"post": "Post-LN", "pre": "Pre-LN"}


def methods_of(spec: ModelSpec) -> List[str]:
    """``title (paper)`` of every method the model uses: its init scheme's, residual scaling's and layer type's
    records, then every method that is on (each once)."""
    records = [declaring(INIT_SCHEMES[spec.init]), declaring(RESIDUAL_SCALINGS[spec.residual])]
    records += [declaring(LAYER_TYPES[spec.layer_type])] + [METHODS[name] for name in spec.features]
    seen, out = set(), []
    for m in records:
        if m.name not in seen:
            seen.add(m.name)
            out.append(f"{m.title} ({m.paper})" + (f"; released code: {m.code}" if m.code else ""))
    return out


def _stored_options(state: dict, args) -> List[str]:
    """``--name value`` of :data:`TRAINING_OPTIONS` as the checkpoint stored them."""
    cfg = state.get("cfg") if isinstance(state.get("cfg"), dict) else {}
    flat = {}
    for group in ("optimization", "optimizer", "lr_scheduler", "criterion", "dataset", "common"):
        node = cfg.get(group)
        if isinstance(node, dict):
            flat.update({k: v for k, v in node.items() if k != "_name"})
            if group in ("optimizer", "lr_scheduler", "criterion") and node.get("_name"):
                flat[group] = node["_name"]
    flat.update({k: v for k, v in vars(args).items() if k in TRAINING_OPTIONS and k not in flat})
    out = []
    for name in TRAINING_OPTIONS:
        value = flat.get(name)
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        out.append(f"--{name.replace('_', '-')} {value}")
    return out


#: what the quickstart writes beside its checkpoints: sacreBLEU of fairseq-generate's test-set translation
BLEU_FILE = "bleu.txt"


def _bleu(src: str) -> str:
    """The card's BLEU line: the first line of :data:`BLEU_FILE` beside the checkpoint, where there is one."""
    path = os.path.join(os.path.dirname(os.path.abspath(src)), BLEU_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            first = f.readline().strip()
        if first:
            return f"- test-set BLEU of fairseq-generate, as `{BLEU_FILE}` beside the checkpoint records it: `{first}`"
    return "- BLEU: not recorded beside the checkpoint (the quickstart writes `bleu.txt`; `fairseq-generate` prints it)"


def copy_dictionaries(out: str, files: Sequence[str]) -> List[str]:
    """Copy the model's fairseq dictionaries into ``out``; their names there."""
    names = []
    for path in files:
        names.append(os.path.basename(path))
        shutil.copyfile(path, os.path.join(out, names[-1]))
    return names


#: why the tokenizer is code of its own (docs/export_tokenizer.md has the measurement)
REMOTE_CODE = (
    "The tokenizer needs `trust_remote_code=True`: it is the training pipeline's own (the pre-tokeniser, "
    "subword-nmt's BPE with its vocabulary filter, the fairseq dictionary), carried as `tokenization_deepinit.py` "
    "(standard library and transformers only; read it first), because no `tokenizers` BPE reproduces the "
    "vocabulary filter: without it most sentences would get other ids than the model was trained on."
)


def _usage(lm: bool, auto: str, tokenizer: bool, dict_names: Sequence[str], target: Sequence[str] = ()) -> str:
    load = f'from transformers import {auto}\nmodel = {auto}.from_pretrained("OUT")\n'
    if tokenizer:
        decoder = "tokenizer"
        lines = ['tokenizer = AutoTokenizer.from_pretrained("OUT", trust_remote_code=True)\n']
        if target:
            decoder = "target"
            lines.append(f'target = AutoTokenizer.from_pretrained("OUT/{target[0]}", trust_remote_code=True)\n')
        text = "a raw prompt" if lm else "a raw source sentence"
        return (
            "```python\nfrom transformers import AutoTokenizer\n"
            + load
            + "".join(lines)
            + f'batch = tokenizer(["{text}"], return_tensors="pt", padding=True)\n'
            f"print({decoder}.batch_decode(model.generate(**batch), skip_special_tokens=True))\n```\n\n"
            + REMOTE_CODE
            + "\n"
        )
    first = "`</s>` (2) and then the prompt's ids" if lm else "the source ids followed by `</s>` (2)"
    files = ", ".join(f"`{n}`" for n in dict_names)
    return (
        "No tokenizer: this folder does not know how the training text was tokenised. Token ids are the fairseq "
        f"dictionary's ({files}: the word on line k, counting from 0, has id k + 4; `<s>` 0, `<pad>` 1, `</s>` 2, "
        "`<unk>` 3). Tokenise and apply the training's BPE as the data was prepared, map the pieces to ids, and give "
        f"the model {first}:\n\n```python\nimport torch\n{load}ids = torch.tensor([[...]])  # your ids\n"
        "print(model.generate(ids))\n```\n"
    )


def write_card(
    out: str,
    src: str,
    state: dict,
    args,
    spec: ModelSpec,
    route,
    hf,
    auto: str,
    tokenizer: bool,
    dict_names: Sequence[str],
    max_diff: float | None,
    target_tokenizer: Sequence[str] = (),
) -> None:
    """Write ``out/README.md`` (module docstring)."""
    c = hf.config
    lm = route.lm
    history = state.get("optimizer_history") or [{}]
    updates = int(history[-1].get("num_updates", 0) or 0)
    task = state.get("cfg", {}).get("task", {}) if isinstance(state.get("cfg"), dict) else {}
    langs = [] if lm else [str(task.get("source_lang") or "src"), str(task.get("target_lang") or "tgt")]
    heads = c.attention_heads if lm else f"{c.encoder_attention_heads} / {c.decoder_attention_heads}"
    layers = c.num_layers if lm else f"{c.encoder_layers} + {c.decoder_layers}"
    vocab = c.vocab_size if hasattr(c, "vocab_size") and not hasattr(c, "src_vocab_size") else None
    vocab = vocab or f"{c.src_vocab_size} source / {c.tgt_vocab_size} target"
    checked = f"max |log-prob difference| {max_diff:.2e}" if max_diff is not None else "not checked (--no-check)"
    lines = [
        "---",
        "library_name: transformers",
        f"pipeline_tag: {'text-generation' if lm else 'translation'}",
        "tags:\n- fairseq\n- fairseq-deepinit\n- " + str(getattr(args, "arch", "deepinit")),
        *([f"language:\n- {langs[0]}\n- {langs[1]}"] if langs else []),
        "---",
        "",
        f"# {getattr(args, 'arch', 'deepinit')}: {type(hf).__name__}",
        "",
        f"A {'language model' if lm else 'translation model'} trained with fairseq and the fairseq-deepinit plugin, "
        f"exported by `deepinit-export --to huggingface` as transformers' `{type(hf).__name__}`, which computes "
        f"fairseq's own {'Pre-LN transformer_lm' if lm else PLACEMENT[route.placements['encoder']] + ' transformer'}.",
        "",
        "## Model",
        "",
        f"- family: `{getattr(args, 'arch', '?')}`; {route.describe()}",
        *(f"- method: {m}" for m in methods_of(spec)),
        f"- layers {layers}, width {c.d_model}, heads {heads}, vocabulary {vocab}",
        f"- source: `{os.path.abspath(src)}`, {updates} updates; export check: the reloaded model against the "
        f"plugin's on random sentences, teacher-forced, float32 against float64: {checked}",
        "",
        "## Training",
        "",
        f"- data: `{task.get('data', 'not recorded')}`" + (f" ({langs[0]} -> {langs[1]})" if langs else ""),
        "- options stored in the checkpoint: " + (" ".join(f"`{o}`" for o in _stored_options(state, args)) or "none"),
        _bleu(src),
        "",
        "## Use",
        "",
        _usage(lm, auto, tokenizer, dict_names, target_tokenizer),
        "`generation_config.json` is fairseq-generate's default search: beam 5, scores divided by length^1, at most "
        "200 words. On a source the two search alike; after a language model's prompt fairseq also counts the "
        "prompt in the length normalisation, so beams above 1 may rank differently (greedy search is identical).",
        "",
    ]
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


__all__ = ["copy_dictionaries", "methods_of", "write_card"]
