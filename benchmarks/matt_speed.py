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

import argparse
import datetime
import gzip
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "fairseq_deepinit")
DEFAULT_DATA = REPO.parent / "shared" / "data" / "multi30k"
MODELS = {"standard": "dsinit", "matt": "dsinit_matt"}


def child(tool: str, argv: list[str]) -> None:
    """Run ``fairseq-<tool>`` in this process, its meters on the clock chosen by ``MATT_BENCH_CLOCK``.

    With ``cpu`` fairseq's timers (generation time, ``wps``) read this process's CPU time instead
    of the wall clock: on a machine shared with other jobs the wall clock also counts the time
    spent waiting for a core, which is the main source of noise on it.
    """
    import importlib
    import time as _time
    import types

    from fairseq.logging import meters

    if os.environ.get("MATT_BENCH_CLOCK", "wall") == "cpu":
        meters.time = types.SimpleNamespace(perf_counter=_time.process_time)
    sys.argv = [f"fairseq-{tool}", *argv]
    importlib.import_module(f"fairseq_cli.{tool}").cli_main()


def run(tool: str, *args: str, env: dict, log: Path) -> str:
    """Run ``fairseq-<tool>``, its output appended to ``log`` as it comes (``tail -f`` to follow)."""
    cmd = [sys.executable, "-m", f"fairseq_cli.{tool}", *map(str, args)]
    if tool in ("train", "generate"):
        cmd = [sys.executable, __file__, "--child", tool, *map(str, args)]
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        start = f.tell()
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    with open(log) as f:
        f.seek(start)
        text = f.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\nexited {proc.returncode}:\n{text[-4000:]}")
    return text


def prepare(data: Path, work: Path, bs1_sentences: int, env: dict, log: Path) -> Path:
    """Lower-cased, word-level Multi30k de-en, binarised; ``test1`` = the first test sentences."""
    dest = work / "bin"
    if (dest / "test1.de-en.de.bin").exists():
        return dest
    if not (data / "train.de.gz").exists():
        raise SystemExit(f"Multi30k not found at {data}; pass --data")
    raw = work / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, out, limit in (
        ("train", "train", None),
        ("val", "valid", None),
        ("test_2016_flickr", "test", None),
        ("test_2016_flickr", "test1", bs1_sentences),
    ):
        for lang in ("de", "en"):
            with gzip.open(data / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines = [line.strip().lower() for line in itertools.islice(f, limit)]
            (raw / f"{out}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    run(
        "preprocess", "--source-lang", "de", "--target-lang", "en", "--trainpref", raw / "train",
        "--validpref", raw / "valid", "--testpref", f"{raw / 'test'},{raw / 'test1'}", "--destdir", dest,
        "--thresholdsrc", "2", "--thresholdtgt", "2", "--workers", "1", env=env, log=log,
    )  # fmt: skip
    return dest


def train_wps(out: str) -> list[float]:
    """``wps`` of every train_inner line of one fairseq-train run, the first (start-up) dropped."""
    vals = [float(json.loads(m)["wps"]) for m in re.findall(r"train_inner[ |:]+(\{.*\})", out)]
    return vals[1:]


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

    sys.path.insert(0, str(REPO))  # this checkout's plugin, never an installed copy
    import fairseq_deepinit  # noqa: F401  (registers the model)

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


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--work", type=Path, help="working folder (default: a temporary one)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--size", default="iwslt_de_en", help="architecture size suffix (default: iwslt_de_en)")
    p.add_argument("--dims", default="128,512,4,6", help="d,ffn,heads,layers per stack (default 128,512,4,6)")
    p.add_argument("--updates", type=int, default=200)
    p.add_argument("--train-rounds", type=int, default=2, help="interleaved training segments per model")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--batch-sizes", default="1,32,128")
    p.add_argument("--bs1-sentences", type=int, default=100)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        help="what fairseq's timers read: this process's CPU time (default on CPU: robust to other jobs on a "
        "shared machine, needs --threads 1 to mean compute time) or the wall clock (default on CUDA)",
    )
    p.add_argument("--json", type=Path, help="also write every measurement here")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny dims, few updates, 1 rep")
    p.add_argument(
        "--match-source-len",
        action="store_true",
        help="decode every hypothesis to its source length (fairseq-generate --match-source-len), so that both "
        "models run the same number of steps per sentence and sentences/s compare like for like",
    )
    p.add_argument(
        "--skip-train",
        action="store_true",
        help="decode with the checkpoints already in --work (no training, no training row)",
    )
    p.add_argument(
        "--breakdown-steps", type=int, default=14, help="decoding steps of the breakdown (default 14, ~ mean length)"
    )
    p.add_argument(
        "--breakdown-only",
        action="store_true",
        help="only the per-step time breakdown, from the checkpoints already in --work",
    )
    args = p.parse_args()
    if args.quick:
        args.dims, args.updates, args.reps, args.bs1_sentences = "64,128,2,2", 20, 1, 10

    args.clock = args.clock or ("cpu" if args.device == "cpu" else "wall")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    env["MATT_BENCH_CLOCK"] = args.clock
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    work = args.work or Path(tempfile.mkdtemp(prefix="matt_speed_"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "commands.log"
    d, ffn, heads, layers = (int(x) for x in args.dims.split(","))
    dims = [
        "--encoder-embed-dim", d, "--decoder-embed-dim", d, "--encoder-ffn-embed-dim", ffn,
        "--decoder-ffn-embed-dim", ffn, "--encoder-attention-heads", heads, "--decoder-attention-heads", heads,
        "--encoder-layers", layers, "--decoder-layers", layers,
    ]  # fmt: skip
    t0 = time.time()
    load0 = os.getloadavg()[0]
    bin_dir = prepare(args.data, work, args.bs1_sentences, env, log)
    print(f"data ready in {work} ({time.time() - t0:.0f}s)", flush=True)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
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
                "--share-decoder-input-output-embed", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
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
            print(f"train {name}: {target} updates, median wps so far {med(wps[name]):.0f}", flush=True)

    # 2. decoding, interleaved, model order alternating
    gen: dict = {(name, bs): [] for name in MODELS for bs in batch_sizes}
    for rep in range(args.reps):
        for bs in batch_sizes:
            order = list(MODELS) if rep % 2 == 0 else list(reversed(MODELS))
            for name in order:
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
            f"| decode, batch {bs}, beam 4 | {med([x['sent_per_s'] for x in std]):.2f} sent/s | "
            f"{med([x['sent_per_s'] for x in mt]):.2f} sent/s | **{med(ratios):.2f}x** "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {med(tok_ratio):.2f}x | "
            f"{std[0]['tokens'] / std[0]['sentences']:.1f} / {mt[0]['tokens'] / mt[0]['sentences']:.1f} |"
        )
    if wps["standard"] and wps["matt"]:
        wr = med(wps["matt"]) / med(wps["standard"])
        rows.append(
            f"| train (target tokens/s) | {med(wps['standard']):.0f} | {med(wps['matt']):.0f} | **{wr:.2f}x** | | |"
        )
    bleu = {name: gen[(name, batch_sizes[-1])][0]["bleu"] for name in MODELS}
    header = (
        "| measurement | standard decoder | MAtt | MAtt / standard (median, min-max) | tokens/s ratio | "
        "output tokens per sentence (std / MAtt) |\n|---|---|---|---|---|---|"
    )
    cmd = " ".join(["python", "benchmarks/matt_speed.py", *sys.argv[1:]])
    summary = "\n".join(
        [
            f"date: {datetime.datetime.now().isoformat(timespec='minutes')}; command: `OMP_NUM_THREADS="
            f"{args.threads} {cmd}`",
            f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, device "
            f"{args.device}, {args.threads} thread(s), timers on the {args.clock} clock; load average at start "
            f"{load0:.1f}, at end {os.getloadavg()[0]:.1f}",
            f"models: {args.size} family, d={d}, FFN {ffn}, {heads} heads, {layers}+{layers} layers, "
            f"{args.updates} updates of {args.max_tokens} tokens; parameters standard {params.get('standard')}, "
            f"MAtt {params.get('matt')}; test BLEU (beam 4) standard {bleu['standard']}, MAtt {bleu['matt']}"
            + ("; hypotheses forced to the source length (--match-source-len)" if args.match_source_len else ""),
            "",
            header,
            *rows,
        ]
    )
    print("\n" + summary)
    print("\nwhere a decoding step's time goes (CPU time, in-process, same checkpoints):\n")
    print(breakdown(work, bin_dir, batch_sizes, args.threads, steps=args.breakdown_steps))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"wps": wps, "params": params, "generate": {f"{k[0]}@{k[1]}": v for k, v in gen.items()}}, indent=1
            )
        )
    print(f"\nlogs: {log} (total {time.time() - t0:.0f}s)")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3:])
    else:
        main()
