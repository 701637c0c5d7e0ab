"""Helpers the paper recipes (``examples/<paper>/<table>.sh``) call: corpus cleaning, checkpoint
averaging and BLEU scoring. Run as ``python examples/recipe_tools.py <command> ...``.

- ``clean``: Moses' ``clean-corpus-n.perl`` (what fairseq's prepare scripts run), in Python, so a
  recipe on local, already tokenised files needs no Moses checkout;
- ``average``: fairseq's ``scripts/average_checkpoints.py`` (ve-fairseq does not ship it), through
  ``fairseq.checkpoint_utils`` so that checkpoints load under torch >= 2.6;
- ``score``: BLEU of a ``fairseq-generate`` output the way each paper reports it: tokenized BLEU
  (what fairseq-generate and multi-bleu.perl print), tokenized BLEU with compound splitting
  (Vaswani et al.'s ``get_ende_bleu.sh``, fairseq's ``compound_split_bleu.sh``) or sacreBLEU on
  detokenised output against the raw reference.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parent.parent


class RecipeError(Exception):
    """A problem with the recipe's inputs; the message says what to do."""


# ---------------------------------------------------------------------------------------------
# clean-corpus-n


def _normalise(line: str) -> str:
    # clean-corpus-n.perl: drop '|' (Moses' factor separator), collapse whitespace, trim
    return " ".join(line.replace("|", "").split())


def clean_pair(src: str, tgt: str, min_len: int, max_len: int, ratio: float) -> Tuple[str, str] | None:
    """The pair as ``clean-corpus-n.perl -ratio R in s t out MIN MAX`` keeps it, or None if dropped."""
    s, t = _normalise(src), _normalise(tgt)
    if not s or not t:
        return None
    ns, nt = len(s.split(" ")), len(t.split(" "))
    if not (min_len <= ns <= max_len and min_len <= nt <= max_len):
        return None
    if ns / nt > ratio or nt / ns > ratio:
        return None
    return s, t


def clean_files(
    src_in: Path, tgt_in: Path, src_out: Path, tgt_out: Path, min_len: int, max_len: int, ratio: float
) -> Tuple[int, int]:
    """Filter a parallel corpus; returns (lines read, lines kept). Unequal line counts are an error."""
    read = kept = 0
    with (
        open(src_in, encoding="utf-8") as fs,
        open(tgt_in, encoding="utf-8") as ft,
        open(src_out, "w", encoding="utf-8") as os_,
        open(tgt_out, "w", encoding="utf-8") as ot,
    ):
        for s in fs:
            t = ft.readline()
            if not t:
                raise RecipeError(f"{tgt_in} has fewer lines than {src_in}; the corpus is not parallel")
            read += 1
            pair = clean_pair(s, t, min_len, max_len, ratio)
            if pair is not None:
                kept += 1
                os_.write(pair[0] + "\n")
                ot.write(pair[1] + "\n")
        if ft.readline():
            raise RecipeError(f"{src_in} has fewer lines than {tgt_in}; the corpus is not parallel")
    return read, kept


# ---------------------------------------------------------------------------------------------
# checkpoint averaging

_PATTERNS = {"epoch": re.compile(r"^checkpoint(\d+)\.pt$"), "update": re.compile(r"^checkpoint_\d+_(\d+)\.pt$")}


def last_checkpoints(folder: Path, mode: str, n: int, upper_bound: int | None = None) -> List[Path]:
    """The ``n`` newest epoch (``checkpointE.pt``) or update (``checkpoint_E_U.pt``) checkpoints,
    newest first, numbered at most ``upper_bound`` (fairseq's ``--checkpoint-upper-bound``)."""
    found = []
    for p in folder.iterdir():
        m = _PATTERNS[mode].match(p.name)
        if m and (upper_bound is None or int(m.group(1)) <= upper_bound):
            found.append((int(m.group(1)), p))
    found.sort(reverse=True)
    if len(found) < n:
        bound = f" numbered <= {upper_bound}" if upper_bound is not None else ""
        raise RecipeError(
            f"found {len(found)} {mode} checkpoint(s){bound} in {folder}, need {n} to average; train longer "
            f"or set AVG_N={len(found) or 1} (AVG_N=0 uses checkpoint_best.pt)"
        )
    return [p for _, p in found[:n]]


def average_states(states: List[dict]) -> dict:
    """Element-wise mean of the ``model`` entries (the first state's other entries are kept).

    Float tensors are summed in float64 and cast back; integer/bool buffers (counters, flags such as
    Admin's ``profiled``) must agree across checkpoints and are kept as they are.
    """
    import torch

    keys = list(states[0]["model"].keys())
    for i, st in enumerate(states[1:], start=1):
        if list(st["model"].keys()) != keys:
            diff = sorted(set(keys) ^ set(st["model"].keys()))
            raise RecipeError(f"checkpoint {i} has different parameters ({diff[:5]}); average one run's checkpoints")
    averaged: Dict[str, torch.Tensor] = {}
    for k in keys:
        tensors = [st["model"][k] for st in states]
        if tensors[0].is_floating_point():
            acc = torch.zeros_like(tensors[0], dtype=torch.float64)
            for t in tensors:
                acc += t.to(torch.float64)
            averaged[k] = (acc / len(tensors)).to(tensors[0].dtype)
        else:
            if any(not torch.equal(t, tensors[0]) for t in tensors[1:]):
                raise RecipeError(f"non-float entry {k!r} differs between checkpoints; it cannot be averaged")
            averaged[k] = tensors[0].clone()
    out = dict(states[0])
    out["model"] = averaged
    return out


def average_checkpoints(paths: List[Path], output: Path) -> None:
    sys.path.insert(0, str(REPO))
    from fairseq import checkpoint_utils
    from omegaconf import OmegaConf

    import fairseq_deepinit  # noqa: F401  (registers the model; makes checkpoints loadable under torch >= 2.6)

    states = [checkpoint_utils.load_checkpoint_to_cpu(str(p)) for p in paths]
    merged = average_states(states)
    if OmegaConf.is_config(merged.get("cfg")):
        # loading turned the config into a DictConfig; fairseq saves it as plain containers (which
        # is also what torch's weights_only loading accepts)
        merged["cfg"] = OmegaConf.to_container(merged["cfg"])
    tmp = output.with_name(output.name + ".tmp")
    checkpoint_utils.torch_persistent_save(merged, str(tmp))
    tmp.replace(output)


# ---------------------------------------------------------------------------------------------
# scoring


def read_generate(path: Path) -> Tuple[List[str], List[str]]:
    """(hypotheses, references) of a fairseq-generate output, in sentence-id order.

    fairseq-generate prints sentences in length-sorted batch order; ``H-<id>`` holds the
    hypothesis after ``--remove-bpe``, ``T-<id>`` the reference as fairseq-generate scores it.
    """
    hyps: Dict[int, str] = {}
    refs: Dict[int, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("H-"):
                key, _score, *text = line.rstrip("\n").split("\t")
                hyps[int(key[2:])] = text[0] if text else ""
            elif line.startswith("T-"):
                key, *text = line.rstrip("\n").split("\t")
                refs[int(key[2:])] = text[0] if text else ""
    if not hyps:
        raise RecipeError(f"{path} has no H- lines; is it the output of fairseq-generate (without --quiet)?")
    if sorted(hyps) != list(range(len(hyps))) or sorted(refs) != sorted(hyps):
        missing = sorted(set(range(max(hyps) + 1)) - set(hyps))[:5]
        raise RecipeError(
            f"{path}: {len(hyps)} hypotheses with gaps (missing ids {missing}); generation was cut short. "
            "Re-run fairseq-generate with --required-batch-size-multiple 1"
        )
    return [hyps[i] for i in range(len(hyps))], [refs[i] for i in range(len(hyps))]


def compound_split(line: str) -> str:
    """``get_ende_bleu.sh``: ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``."""
    return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line)


def tokenized_bleu(hyps: List[str], refs: List[str]) -> object:
    """Corpus BLEU-4 on whitespace tokens, no smoothing: multi-bleu.perl's and fairseq-generate's number."""
    from sacrebleu.metrics import BLEU

    return BLEU(tokenize="none", smooth_method="none", force=True).corpus_score(hyps, [refs])


def score(gen: Path, mode: str, ref: Path | None = None, detok_cmd: str | None = None) -> str:
    """One line: ``BLEU = <score> (<mode>) ...``; the first number is the one to compare with the paper."""
    hyps, refs = read_generate(gen)
    if mode == "tok":
        result = tokenized_bleu(hyps, refs)
        return f"BLEU = {result.score:.2f} (tokenized, case-sensitive, multi-bleu.perl equivalent; {result})"
    if mode == "compound":
        result = tokenized_bleu([compound_split(h) for h in hyps], [compound_split(r) for r in refs])
        return f"BLEU = {result.score:.2f} (tokenized, compound-split as get_ende_bleu.sh; {result})"
    if mode == "sacrebleu":
        import sacrebleu

        if ref is None or detok_cmd is None:
            raise RecipeError("sacreBLEU needs --ref (the raw reference) and --detok-cmd (Moses' detokenizer)")
        raw_refs = Path(ref).read_text(encoding="utf-8").splitlines()
        if len(raw_refs) != len(hyps):
            raise RecipeError(f"{ref} has {len(raw_refs)} lines but {gen} has {len(hyps)} hypotheses")
        proc = subprocess.run(
            shlex.split(detok_cmd), input="\n".join(hyps) + "\n", capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RecipeError(f"detokenizer failed ({detok_cmd}): {proc.stderr[-500:]}")
        detok = proc.stdout.splitlines()
        if len(detok) != len(hyps):
            raise RecipeError(f"detokenizer returned {len(detok)} lines for {len(hyps)} hypotheses")
        bleu = sacrebleu.metrics.BLEU()
        result = bleu.corpus_score(detok, [raw_refs])
        return f"BLEU = {result.score:.2f} (sacreBLEU, detokenized; {result}; {bleu.get_signature()})"
    raise RecipeError(f"unknown score mode {mode!r}; choose from tok, compound, sacrebleu")


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("clean", help="clean-corpus-n.perl: drop empty, too long or too unbalanced pairs")
    p.add_argument("src_in", type=Path)
    p.add_argument("tgt_in", type=Path)
    p.add_argument("src_out", type=Path)
    p.add_argument("tgt_out", type=Path)
    p.add_argument("--min", type=int, default=1)
    p.add_argument("--max", type=int, required=True)
    p.add_argument("--ratio", type=float, default=9.0, help="clean-corpus-n.perl's default is 9")
    p = sub.add_parser("average", help="average the last N epoch or update checkpoints of a run")
    p.add_argument("--inputs", type=Path, required=True, help="the run's --save-dir")
    p.add_argument("--mode", choices=sorted(_PATTERNS), required=True)
    p.add_argument("--num", type=int, required=True)
    p.add_argument("--upper-bound", type=int, help="only checkpoints numbered <= this (epochs or updates)")
    p.add_argument("--output", type=Path, required=True)
    p = sub.add_parser("score", help="BLEU of a fairseq-generate output")
    p.add_argument("gen", type=Path)
    p.add_argument("--mode", choices=("tok", "compound", "sacrebleu"), required=True)
    p.add_argument("--ref", type=Path, help="sacrebleu: the raw (untokenized) reference, one line per sentence")
    p.add_argument("--detok-cmd", help="sacrebleu: command that detokenizes stdin (Moses detokenizer.perl)")
    args = parser.parse_args(argv)
    try:
        if args.command == "clean":
            read, kept = clean_files(
                args.src_in, args.tgt_in, args.src_out, args.tgt_out, args.min, args.max, args.ratio
            )
            print(f"clean: kept {kept} of {read} pairs (length {args.min}-{args.max}, ratio {args.ratio})")
        elif args.command == "average":
            if args.num < 1:
                raise RecipeError("--num must be at least 1")
            paths = last_checkpoints(args.inputs, args.mode, args.num, args.upper_bound)
            average_checkpoints(paths, args.output)
            print(f"averaged {len(paths)} checkpoints ({', '.join(p.name for p in paths)}) -> {args.output}")
        else:
            print(score(args.gen, args.mode, args.ref, args.detok_cmd))
    except (RecipeError, OSError) as e:  # bad input or a missing / unreadable file: one line, status 1
        print(f"recipe_tools.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
