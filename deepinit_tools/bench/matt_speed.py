#!/usr/bin/env python
"""Decoding and training speed of MAtt against the standard decoder, with the real fairseq CLIs.

Zhang, Titov & Sennrich 2019 report that MAtt decodes 1.54x and trains 1.12x faster than the
standard decoder (WMT14 En-De base, 6 layers, TensorFlow). This script measures the same two
ratios for this plugin on Multi30k de-en (read in place, word level):

1. Both models (``--arch dsinit_<size>`` vs ``dsinit_matt_<size>``: same DS-Init, same dims and
   depth, only ``--decoder-layer-type`` differs) are trained the same number of updates with
   ``fairseq-train``, interleaved in ``--train-rounds`` segments (each segment resumes from the
   previous checkpoint), so slow drifts of a shared machine hit both alike. Training tokens/s:
   the median ``wps`` of the ``train_inner`` log lines, the first of each segment (start-up)
   dropped.
2. ``fairseq-generate --beam 4`` at each ``--batch-sizes`` value, both models side by side,
   ``--reps`` rounds, the order of the models alternating. Sentences/s is fairseq's own figure
   (generation time only: "Translated N sentences ... in Xs"). Batch size 1 decodes the first
   ``--bs1-sentences`` test sentences, the others the whole 2016 Flickr test set (1,000).

Ratios are medians over rounds of the per-round ratio MAtt / standard (paired within a round).
Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/matt_speed.py                 # CPU, ~25 min
    .venv/bin/python benchmarks/matt_speed.py --device cuda --updates 2000      # GPU
    .venv/bin/python benchmarks/matt_speed.py --quick                           # smoke run
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

from deepinit_tools import fairseq_argv as fa
from deepinit_tools import harness
from deepinit_tools.harness.fairseq_tools import run_tool, train_inner
from deepinit_tools.harness.timing import median
from deepinit_tools.multi30k import DEFAULT_MULTI30K, binarize_multi30k
from deepinit_tools.paths import USER_DIR, tools_env

MODELS = {"standard": "dsinit", "matt": "dsinit_matt"}
DECODE_TARGET = 1.5  # Zhang et al. 2019: MAtt decodes 1.54x faster


def plugin() -> None:
    """Every import from fairseq_deepinit in this script (one place, for the package's re-layout)."""
    import fairseq_deepinit  # noqa: F401  (registers the models)


def run(tool: str, *args, env: dict, log: Path) -> str:
    """Run ``fairseq-<tool>`` (its meters on ``MATT_BENCH_CLOCK``), output appended to ``log``."""
    clock = env.get("MATT_BENCH_CLOCK", "wall")
    return run_tool(tool, [str(a) for a in args], env=env, log=log, clock=clock).output


def prepare(data: Path, work: Path, bs1_sentences: int) -> Path:
    """Lower-cased, word-level Multi30k de-en, binarised; ``test1`` = the first test sentences."""
    splits = {"train": ("train", None), "valid": ("val", None), "test": ("test_2016_flickr", None),
              "test1": ("test_2016_flickr", bs1_sentences)}  # fmt: skip
    return binarize_multi30k(data, work / "bin", splits, tokenizer="lower")


def train_wps(out: str) -> list[float]:
    """``wps`` of every train_inner line of one fairseq-train run, the first (start-up) dropped."""
    return [r["wps"] for r in train_inner(out)[1:]]


def generate(bin_dir: Path, ckpt: Path, subset: str, bs: int, args, env: dict, log: Path) -> dict:
    out = run(
        "generate", bin_dir, "--user-dir", USER_DIR, "--path", ckpt, "--gen-subset", subset, "--beam", "4",
        "--batch-size", bs, "--required-batch-size-multiple", "1", "--quiet", "--num-workers", "0",
        *(["--cpu"] if args.device == "cpu" else []), *(["--fp16"] if args.fp16 else []),
        *(["--match-source-len"] if args.match_source_len else []),
        env=env, log=log,
    )  # fmt: skip
    m = re.search(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s \(([\d.]+) sentences/s", out)
    if m is None:
        raise SystemExit(f"no timing line in fairseq-generate output:\n{out[-2000:]}")
    bleu = re.search(r"BLEU4? = ([\d.]+)", out)
    n, tokens = int(m.group(1).replace(",", "")), int(m.group(2).replace(",", ""))
    return {
        "sentences": n,
        "tokens": tokens,
        "seconds": float(m.group(3)),
        "sent_per_s": float(m.group(4)),
        "bleu": float(bleu.group(1)) if bleu else None,
    }


def breakdown(work: Path, bin_dir: Path, batch_sizes: list[int], threads: int, steps: int = 14, reps: int = 5) -> str:
    """Where a decoding step's time goes: CPU time of the encoder, the decoder layers (incremental),
    the beam reordering of their state, and the output layer + log-softmax, both models in turn.

    The trained checkpoints decode ``4 x batch`` hypotheses of the first test sentences for ``steps``
    steps (about the mean output length), reordering the state with a random beam permutation
    after every step as beam search does. What fairseq-generate adds on top (top-k, finished
    hypotheses, bookkeeping) is the same for both models and not measured here.
    """
    import torch
    from fairseq import checkpoint_utils

    plugin()

    torch.set_num_threads(threads)
    models = {}
    for name in MODELS:
        (model,), _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
            [str(work / name / "checkpoint_last.pt")], arg_overrides={"data": str(bin_dir)}
        )
        model.eval()
        model.decoder.set_beam_size(4)  # fairseq's beamable encoder-decoder cache, as in fairseq-generate
        models[name] = model
    task.load_dataset("test")
    data = task.dataset("test")
    clock = time.process_time
    lines = [
        "| hypotheses (batch x beam 4) | part | standard ms/step | MAtt ms/step | MAtt speed-up |",
        "|---|---|---|---|---|",
    ]
    g = torch.Generator().manual_seed(0)
    for bs in batch_sizes:
        sample = data.collater([data[i] for i in range(bs)])
        src, lengths = sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"]
        beams = torch.arange(bs).repeat_interleave(4)
        prev = torch.randint(4, len(task.target_dictionary), (4 * bs, steps), generator=g)
        # beam search's new_order: every slot of sentence b continues one of b's 4 hypotheses
        perms = [beams * 4 + torch.randint(0, 4, (4 * bs,), generator=g) for _ in range(steps)]
        best: dict = {name: {} for name in models}
        with torch.no_grad():
            for _ in range(reps):
                for name, model in models.items():
                    t = {"encoder": 0.0, "decoder layers": 0.0, "state reorder": 0.0, "output layer": 0.0}
                    t0 = clock()
                    enc = model.encoder(src, lengths)
                    enc = model.encoder.reorder_encoder_out(enc, beams)
                    t["encoder"] += clock() - t0
                    state: dict = {}
                    for step in range(steps):
                        t0 = clock()
                        x, _ = model.decoder.extract_features(prev[:, : step + 1], enc, incremental_state=state)
                        t1 = clock()
                        model.get_normalized_probs((model.decoder.output_layer(x[:, -1:]), None), log_probs=True)
                        t2 = clock()
                        model.decoder.reorder_incremental_state_scripting(state, perms[step])
                        t3 = clock()
                        t["decoder layers"] += t1 - t0
                        t["output layer"] += t2 - t1
                        t["state reorder"] += t3 - t2
                    for part, sec in t.items():
                        best[name][part] = min(best[name].get(part, float("inf")), sec)
        for part in best["standard"]:
            s_ms, m_ms = (1000 * best[name][part] / steps for name in MODELS)
            lines.append(f"| {4 * bs} | {part} | {s_ms:.2f} | {m_ms:.2f} | {s_ms / m_ms:.2f}x |")
        s_all, m_all = (sum(best[name].values()) / steps * 1000 for name in MODELS)
        lines.append(f"| {4 * bs} | **sum** | {s_all:.2f} | {m_all:.2f} | **{s_all / m_all:.2f}x** |")
    return "\n".join(lines)


def build_parser() -> harness.Parser:
    """Every option of matt_speed.py, with its help and default."""
    pos = harness.positive_int
    p = harness.Parser(prog="matt_speed.py", description=__doc__)
    p.add_argument("--data", type=Path, default=DEFAULT_MULTI30K, help="Multi30k's *.gz (env MULTI30K_DIR)")
    p.add_argument("--work", type=Path, help="working folder (default: a temporary one)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train and decode")
    p.add_argument("--fp16", action="store_true", help="fairseq --fp16 for training and decoding (CUDA)")
    p.add_argument("--size", default="iwslt_de_en", help="architecture size suffix")
    p.add_argument("--dims", default="128,512,4,6", help="d,ffn,heads,layers per stack")
    p.add_argument("--updates", type=pos, default=200, help="training updates per model")
    p.add_argument("--train-rounds", type=pos, default=2, help="interleaved training segments per model")
    p.add_argument("--max-tokens", type=pos, default=2048, help="training batch")
    p.add_argument("--batch-sizes", type=harness.int_list,
                   help="decoding batch sizes (default: 1,32,128 on CPU, 1,128 on CUDA)")  # fmt: skip
    p.add_argument("--bs1-sentences", type=pos, default=100, help="test sentences decoded at batch 1")
    p.add_argument("--reps", type=pos, default=3, help="decoding rounds")
    p.add_argument("--threads", type=pos, default=int(os.environ.get("OMP_NUM_THREADS", "1")),
                   help="torch threads of every fairseq process (OMP_NUM_THREADS)")  # fmt: skip
    p.add_argument("--clock", choices=("cpu", "wall"),
                   help="what fairseq's timers read: this process's CPU time (default on CPU: robust to other jobs "
                   "on a shared machine, needs --threads 1 to mean compute time) or the wall clock "
                   "(default on CUDA)")  # fmt: skip
    p.add_argument("--json", type=Path, help="also write every measurement here")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny dims, few updates, 1 rep")
    p.add_argument("--match-source-len", action="store_true",
                   help="decode every hypothesis to its source length (fairseq-generate --match-source-len), so that "
                   "both models run the same number of steps per sentence and sentences/s compare "
                   "like for like")  # fmt: skip
    p.add_argument("--skip-train", action="store_true",
                   help="decode with the checkpoints already in --work (no training, no training row)")  # fmt: skip
    p.add_argument("--breakdown-steps", type=pos, default=14, help="decoding steps of the breakdown (~ mean length)")
    p.add_argument("--breakdown-only", action="store_true",
                   help="only the per-step time breakdown, from the checkpoints already in --work")  # fmt: skip
    p.add_argument("--no-breakdown", action="store_true",
                   help="skip the per-step CPU-time breakdown (always skipped with --device cuda)")  # fmt: skip
    return p


def main(argv=None) -> None:
    """Train both models, decode side by side, print the table (and the CPU breakdown)."""
    args = build_parser().parse_args(argv)
    if args.quick:
        args.dims, args.updates, args.reps, args.bs1_sentences = "64,128,2,2", 20, 1, 10
    if args.fp16 and args.device != "cuda":
        harness.fail("--fp16 needs --device cuda")
    try:
        d, ffn, heads, layers = (int(x) for x in args.dims.split(","))
    except ValueError:
        harness.fail(f"--dims {args.dims!r} is not d,ffn,heads,layers")
    batch_sizes = args.batch_sizes or ([1, 128] if args.device == "cuda" else [1, 32, 128])
    args.clock = args.clock or ("cpu" if args.device == "cpu" else "wall")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    env["MATT_BENCH_CLOCK"] = args.clock
    env = tools_env(env)
    work = args.work or Path(tempfile.mkdtemp(prefix="matt_speed_"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "commands.log"
    dims = fa.dims(layers, d, ffn, heads)
    t0 = time.time()
    load0 = os.getloadavg()[0]
    bin_dir = prepare(args.data, work, args.bs1_sentences)
    print(f"data ready in {work} ({time.time() - t0:.0f}s)", flush=True)
    if args.breakdown_only:
        print(breakdown(work, bin_dir, batch_sizes, args.threads, steps=args.breakdown_steps))
        return

    # 1. training, interleaved segments
    wps: dict = {name: [] for name in MODELS}
    log_every = max(1, min(10, args.updates // args.train_rounds // 4))
    params: dict = {}
    for r in range(1, 0 if args.skip_train else args.train_rounds + 1):
        target = round(args.updates * r / args.train_rounds)
        for name, family in MODELS.items():
            out = run(
                "train", bin_dir, "--user-dir", USER_DIR, "--arch", f"{family}_{args.size}", *dims,
                "--share-decoder-input-output-embed", *fa.ADAM,
                "--lr", "1e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(min(400, args.updates // 3)),
                "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--dropout", "0.1",
                "--max-tokens", args.max_tokens, "--max-update", target, "--save-dir", work / name,
                "--no-epoch-checkpoints", "--log-format", "json", "--log-interval", log_every, "--seed", "1",
                "--num-workers", "0", "--disable-validation", "--save-interval-updates", target,
                *(["--cpu"] if args.device == "cpu" else []), *(["--fp16"] if args.fp16 else []),
                env=env, log=log,
            )  # fmt: skip
            wps[name] += train_wps(out)
            m = re.search(r"num\. (?:shared )?model params: ([\d,]+)", out)
            if m:
                params[name] = int(m.group(1).replace(",", ""))
            print(f"train {name}: {target} updates, median wps so far {median(wps[name]):.0f}", flush=True)

    # 2. decoding, interleaved, model order alternating
    gen: dict = {(name, bs): [] for name in MODELS for bs in batch_sizes}
    for rep in range(args.reps):
        for bs in batch_sizes:
            for name in harness.rotation(list(MODELS), rep):
                subset = "test1" if bs == 1 else "test"
                res = generate(bin_dir, work / name / "checkpoint_last.pt", subset, bs, args, env, log)
                gen[(name, bs)].append(res)
                print(f"rep {rep} bs {bs} {name}: {res['sent_per_s']:.2f} sent/s, BLEU {res['bleu']}", flush=True)

    # 3. table
    rows = []
    for bs in batch_sizes:
        std, mt = gen[("standard", bs)], gen[("matt", bs)]
        ratios = [m["sent_per_s"] / s["sent_per_s"] for s, m in zip(std, mt, strict=True)]
        # fairseq prints the seconds rounded to 0.1 s; sentences/s has two decimals
        tok_ratio = [
            (m["tokens"] * m["sent_per_s"] / m["sentences"]) / (s["tokens"] * s["sent_per_s"] / s["sentences"])
            for s, m in zip(std, mt, strict=True)
        ]
        rows.append(
            f"| decode, batch {bs}, beam 4 | {median([x['sent_per_s'] for x in std]):.2f} sent/s | "
            f"{median([x['sent_per_s'] for x in mt]):.2f} sent/s | **{median(ratios):.2f}x** "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {median(tok_ratio):.2f}x | "
            f"{std[0]['tokens'] / std[0]['sentences']:.1f} / {mt[0]['tokens'] / mt[0]['sentences']:.1f} |"
        )
    if wps["standard"] and wps["matt"]:
        wr = median(wps["matt"]) / median(wps["standard"])
        std_wps, matt_wps = median(wps["standard"]), median(wps["matt"])
        rows.append(f"| train (target tokens/s) | {std_wps:.0f} | {matt_wps:.0f} | **{wr:.2f}x** | | |")
    bleu = {name: gen[(name, batch_sizes[-1])][0]["bleu"] for name in MODELS}
    header = (
        "| measurement | standard decoder | MAtt | MAtt / standard (median, min-max) | tokens/s ratio | "
        "output tokens per sentence (std / MAtt) |\n|---|---|---|---|---|---|"
    )
    verdicts = []
    for bs in (1, 128):
        if bs in batch_sizes:
            r = median(
                [
                    m["sent_per_s"] / s["sent_per_s"]
                    for s, m in zip(gen[("standard", bs)], gen[("matt", bs)], strict=True)
                ]
            )
            verdicts.append(f"- decode batch {bs}: MAtt {r:.2f}x standard; target >= {DECODE_TARGET}: "
                            f"{'MET' if r >= DECODE_TARGET else 'MISSED'}")  # fmt: skip
    meta = harness.environment(args.device, "matt_speed.py", argv)
    summary = "\n".join(
        [
            harness.provenance(meta),
            f"timers on the {args.clock} clock, {args.threads} thread(s); load average at start {load0:.1f}, at end "
            f"{os.getloadavg()[0]:.1f}",
            f"models: {args.size} family, d={d}, FFN {ffn}, {heads} heads, {layers}+{layers} layers, "
            f"{args.updates} updates of {args.max_tokens} tokens; parameters standard {params.get('standard')}, "
            f"MAtt {params.get('matt')}; test BLEU (beam 4) standard {bleu['standard']}, MAtt {bleu['matt']}"
            + ("; hypotheses forced to the source length (--match-source-len)" if args.match_source_len else ""),
            "",
            header,
            *rows,
            "",
            *verdicts,
        ]
    )
    print("\n" + summary)
    if args.no_breakdown or args.device == "cuda":
        print("\n(per-step breakdown skipped: it instruments CPU time only)")
    else:
        print("\nwhere a decoding step's time goes (CPU time, in-process, same checkpoints):\n")
        print(breakdown(work, bin_dir, batch_sizes, args.threads, steps=args.breakdown_steps))
    payload = {"wps": wps, "params": params, "generate": {f"{k[0]}@{k[1]}": v for k, v in gen.items()}}
    harness.write_json(args.json, payload, meta)
    print(f"\nlogs: {log} (total {time.time() - t0:.0f}s)")
