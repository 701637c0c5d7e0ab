"""The report of benchmarks/throughput.py: the targets' verdicts and the ready-to-paste markdown."""

from __future__ import annotations

from typing import List

from deepinit_tools import harness
from deepinit_tools.bench.configs import CONFIGS, INIT_ONLY_TARGET, NORM_COMPARISONS
from deepinit_tools.harness.timing import median


def verdicts(results: dict) -> List[str]:
    """Targets on the median paired wall-clock ratios: init-only >= 0.98x stock, ScaleNorm >= LayerNorm.

    The CPU-time ratio is printed beside it: on a shared machine it is the steadier of the two.
    """
    lines = []
    for shape, rows in results["shapes"].items():
        checks = [
            (name, CONFIGS[name].ref, "ratio_to_ref", INIT_ONLY_TARGET) for name in rows if CONFIGS[name].init_only
        ]
        checks += [(num, den, f"ratio_to_{den}", target) for num, den, target in NORM_COMPARISONS if num in rows]
        for name, ref, key, target in checks:
            row = rows[name]
            if not row.get(key):
                continue
            text = f"{shape} {name} vs {ref}: wall {harness.Stat.of(row[key]).text()}"
            if row.get(f"cpu_{key}"):
                text += f", CPU time {harness.Stat.of(row[f'cpu_{key}']).text()}"
            if target is not None:
                text += f"; target >= {target:.2f}: {'MET' if median(row[key]) >= target else 'MISSED'}"
            lines.append(text)
    return lines


def markdown(results: dict) -> str:
    """The ready-to-paste report: provenance, one table per shape, the targets."""
    meta = results["meta"]
    inprocess = meta["mode"] == "inprocess"
    cpu_cols = inprocess and meta["device"] == "cpu"
    if inprocess:
        how = f"in-process timing, {meta['steps']} steps per trial"
    else:
        how = (f"fairseq-train timing, --max-update {meta['cli_updates']}, median wps of the train_inner lines "
               f"(--log-interval {meta['cli_log_interval']}, the first dropped)")  # fmt: skip
    out = [
        f"{meta['precision']}; {how}, --max-tokens {meta['max_tokens']}, {meta['repeats']} interleaved rounds.",
        harness.provenance(meta),
        "",
        "tok/s: target tokens per second (fairseq's wps), median over rounds [min-max]. x ref: median of the "
        "per-round ratios to the stock `transformer` at the same norm position (the `ref` column) [min-max]"
        + ("; CPU: the same ratio over process CPU time, insensitive to other processes." if cpu_cols else ".")
        + (" Peak: memory growth while building and training the model." if inprocess else " Peak: process RSS."),
        "",
    ]
    for shape, rows in results["shapes"].items():
        header = ["config", "what", "ref", "params", "tok/s", "x ref (wall)"]
        header += ["x ref (CPU)"] if cpu_cols else []
        header += ["peak MiB", "mem x ref"]
        table = []
        for name, row in rows.items():
            cfg = CONFIGS[name]
            mem = row.get("peak_mib", row.get("peak_rss_mib"))
            ref_row = rows.get(cfg.ref, {})
            ref_mem = ref_row.get("peak_mib", ref_row.get("peak_rss_mib"))
            cells = [
                name,
                cfg.what,
                "-" if cfg.ref == name else cfg.ref,
                f"{row['params'] / 1e6:.2f}M" if "params" in row else "n/a",
                harness.Stat.of(row["tokens_per_s"]).text("{:.0f}"),
                harness.Stat.of(row["ratio_to_ref"]).text(),
            ]
            if cpu_cols:
                cells.append(harness.Stat.of(row["cpu_ratio_to_ref"]).text())
            cells.append("n/a" if mem is None else f"{mem:.0f}")
            cells.append("n/a" if mem is None or not ref_mem else f"{mem / ref_mem:.2f}")
            table.append(cells)
        right = range(3, len(header))
        out += [f"**{shape}** (layers x d x FFN x heads, encoder and decoder)", "",
                harness.markdown_table(header, table, right), ""]  # fmt: skip
    out += ["Targets (median paired ratios, wall clock):", ""] + [f"- {line}" for line in verdicts(results)]
    return "\n".join(out)
