"""The export tests' models: every family of docs/export.md's table, tiny, with weights a route could get wrong.

:func:`build_case` builds ``<family>_iwslt_de_en`` / ``<family>_lm_tiny`` at tiny dims (d 32, 4 heads of 8,
2 + 3 layers, dropout 0) as fairseq-train would, then moves every parameter an export must carry away from
its init: norm gains and biases off 1 and 0, every learned scalar and vector of the residuals (Admin's omega,
ReZero's a, ScaleNorm's g) off its start, and ``</s>``'s output row moved along the decoder's mean final
state (FixNorm: its output bias raised) so that beam search ends sentences at varied lengths (an untrained
model rarely picks ``</s>``, and a search that only stops at the length limit is not one fairseq and
CTranslate2 define alike: fairseq forces ``</s>`` there, CTranslate2 cuts), and ``<pad>``'s the other way,
as training leaves it (fairseq never generates it; docs/export.md, decoding). :func:`write_checkpoint` saves such a
model as fairseq-train does (``cfg.model`` a Namespace) with its dictionaries.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import torch

from conftest import make_dictionary

N_SYMBOLS = 40
DIMS_MT = [
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--encoder-layers", "2", "--decoder-layers", "3", "--dropout", "0",
]  # fmt: skip
DIMS_LM = [
    "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4",
    "--decoder-layers", "3", "--dropout", "0", "--tokens-per-sample", "64",
]  # fmt: skip

Case = Tuple[str, Tuple[str, ...], bool]  # (family, extra flags, language model)


def cases() -> List[Case]:
    """Every (family or variant, kind) of docs/export.md's table."""
    from fairseq_deepinit.export.table import families
    from fairseq_deepinit.lm.architectures import LM_FAMILIES

    out = []
    for family, extra in families():
        out.append((family, extra, False))
        if family in LM_FAMILIES and "--no-qk-norm-cross" not in extra:
            out.append((family, extra, True))
    return out


def case_id(case: Case) -> str:
    family, extra, lm = case
    return ("lm:" if lm else "") + family + ("".join(extra).replace("--", "+") if extra else "")


def parse(case: Case):
    """``(args, task)`` as fairseq-train resolves them (the model not built)."""
    from fairseq import options, tasks

    family, extra, lm = case
    d = make_dictionary(N_SYMBOLS)
    if lm:
        argv = ["/nonexistent", "--task", "language_modeling", "--arch", f"{family}_lm_tiny", *DIMS_LM, *extra]
        args = options.parse_args_and_arch(options.get_training_parser(), argv)
        task = tasks.TASK_REGISTRY["language_modeling"](args, d, d)
    else:
        argv = ["/nonexistent", "--task", "translation", "-s", "src", "-t", "tgt", "--arch", f"{family}_iwslt_de_en"]
        args = options.parse_args_and_arch(options.get_training_parser(), [*argv, *DIMS_MT, *extra])
        task = tasks.TASK_REGISTRY["translation"](args, d, d)
    return args, task


def resolved(case: Case):
    """The case's arguments resolved as the model's build resolves them (what a checkpoint stores)."""
    import copy

    from fairseq_deepinit import options
    from fairseq_deepinit.lm.model import resolve_lm_args

    args = copy.deepcopy(parse(case)[0])
    resolve_lm_args(args) if case[2] else options.resolve_and_validate(args)
    return args


EOS_LOGIT = 6.0  # what the mean final state adds to the logit of </s>


def mean_final_state(model) -> torch.Tensor:
    """The decoder's final state (before the output projection) averaged over a random batch."""
    model.eval()
    g = torch.Generator().manual_seed(0)
    d = model.decoder.dictionary
    prev = torch.randint(d.nspecial, len(d), (8, 10), generator=g)
    if getattr(model, "encoder", None) is None:
        features = model.decoder(prev, features_only=True)[0]
    else:
        src = torch.randint(d.nspecial, len(d), (8, 9), generator=g)
        enc = model.encoder(src, src_lengths=torch.full((8,), 9))
        features = model.decoder(prev, encoder_out=enc, features_only=True)[0]
    return features.mean((0, 1))


@torch.no_grad()
def build_case(case: Case, seed: int = 1):
    """``(model, args)``: the case's model with every exported parameter away from its init (module docstring)."""
    args, task = parse(case)
    torch.manual_seed(seed)
    model = task.build_model(args)
    g = torch.Generator().manual_seed(seed + 10)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and leaf in ("weight", "bias"):
            p.copy_((1.0 if leaf == "weight" else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
        elif leaf in ("omega", "alpha", "g"):
            p.mul_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g)).add_(0.3)
        elif leaf == "bias" and "output_projection" in name:  # FixNorm's output bias
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    for module in model.modules():
        if hasattr(module, "mark_profiled"):  # Admin: omega counts as profiled (the export refuses it otherwise)
            module.mark_profiled()
    eos, pad = model.decoder.dictionary.eos(), model.decoder.dictionary.pad()
    projection = model.decoder.output_projection
    if hasattr(projection, "embedding"):  # FixNorm: unit rows, the bias decides
        projection.bias[eos] += 4.0
        projection.bias[pad] -= 6.0
    else:  # the output rows of </s> and <pad> along the mean final state: </s> likely in most contexts
        h = mean_final_state(model)
        projection.weight[eos] += EOS_LOGIT * h / h.dot(h)
        projection.weight[pad] -= EOS_LOGIT * h / h.dot(h)
    model.eval()
    return model, args


def write_checkpoint(model, args, folder: Path, name: str = "checkpoint.pt") -> Tuple[Path, Path]:
    """``(checkpoint, data folder)``: ``model`` saved as fairseq-train saves it, its dictionaries beside."""
    import copy

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data"
    data.mkdir(exist_ok=True)
    lm = getattr(model, "encoder", None) is None
    files = ["dict.txt"] if lm else ["dict.src.txt", "dict.tgt.txt"]
    for file, d in zip(files, [model.decoder.dictionary] * len(files), strict=True):
        d.save(str(data / file))
    task = {"_name": "language_modeling" if lm else "translation", "data": str(data)}
    if not lm:
        task.update(source_lang="src", target_lang="tgt")
    state = {
        "args": None,
        "cfg": {"model": copy.deepcopy(args), "task": task, "common": {"user_dir": "fairseq_deepinit"}},
        "model": model.state_dict(),
        "optimizer_history": [
            {
                "criterion_name": "CrossEntropyCriterion",
                "optimizer_name": "Adam",
                "lr_scheduler_state": {"best": 3.5},
                "num_updates": 7,
                "optimizer": {},
            }
        ],
        "extra_state": {},
    }
    path = folder / name
    torch.save(state, path)
    return path, data
