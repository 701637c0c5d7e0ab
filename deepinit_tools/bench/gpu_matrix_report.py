"""The GPU matrix's report: its table rows, the targets' verdicts and the markdown."""

from __future__ import annotations

import math
from typing import List, Mapping

from deepinit_tools import harness
from deepinit_tools.bench.gpu_matrix_rows import (
    FAST_TARGET,
    INIT_ONLY,
    INIT_ONLY_TARGET,
    LOSS_TOLERANCE,
    NORM_TARGET,
    Row,
)
from deepinit_tools.harness import flops
from deepinit_tools.harness.fairseq_train import (
    Variant,
)


def table_rows(results: Mapping[Row, dict], device_name: str) -> List[dict]:
    """The rows of docs/benchmarks/gpu.json: one row per configuration (+ ``note``)."""
    rows = []
    for row, rec in results.items():
        rates = rec.get("rates") or []
        tps = harness.median([r for r in rates if math.isfinite(r)])
        seconds = rec.get("seconds") or []
        fps = harness.median([rec["flops_per_trial"] / s for s in seconds]) if seconds else math.nan
        out = {
            "config": row.label,
            "layers": row.layers,
            "device": device_name,
            "precision": row.variant.precision,
            "tokens_per_s": None if not math.isfinite(tps) else round(tps, 1),
            "ratio_to_stock": None if not rec.get("ratios") else round(harness.median(rec["ratios"]), 4),
            "peak_mem_gib": None if rec.get("peak_mib") is None else round(rec["peak_mib"] / 1024, 3),
            "mfu": None
            if not math.isfinite(fps) or flops.mfu(fps, device_name) is None
            else round(flops.mfu(fps, device_name), 4),
        }
        if rec.get("note"):
            out["note"] = rec["note"]
        rows.append(out)
    return rows


def targets(results: Mapping[Row, dict], loss: dict | None, first: int) -> List[str]:
    """The issue's targets on the first (6-layer) depth, as MET / MISSED lines."""
    lines = []

    def ratio(row: Row) -> float:
        return harness.median(results.get(row, {}).get("ratios") or [])

    plugin = [r for r in results if r.config == "plugin" and r.layers == first and results[r].get("rates")]
    if plugin:
        fast = max(plugin, key=lambda r: harness.median(results[r]["rates"]))
        got = ratio(fast)
        base = results[fast].get("baseline") or "no stock row measured in this pass"
        lines.append(
            f"fastest plugin path {fast.key} vs {base}: {got:.3f}x; target >= {FAST_TARGET:.2f}: "
            f"{_verdict(got, FAST_TARGET)}"
        )
    for name in INIT_ONLY:
        row = Row(name, Variant("fp16"), first)
        if results.get(row, {}).get("ratios"):
            got = ratio(row)
            lines.append(
                f"{row.key} vs {results[row]['baseline']}: {harness.Stat.of(results[row]['ratios']).text()}; "
                f"target >= {INIT_ONLY_TARGET:.2f}: {_verdict(got, INIT_ONLY_TARGET)}"
            )
    sn = results.get(Row("preln-scalenorm", Variant("fp16"), first), {})
    if sn.get("ratios_to_preln"):
        got = harness.median(sn["ratios_to_preln"])
        lines.append(
            f"ScaleNorm vs LayerNorm (Pre-norm, fp16, {first}L): {harness.Stat.of(sn['ratios_to_preln']).text()}; "
            f"target >= {NORM_TARGET:.2f}: {_verdict(got, NORM_TARGET)}"
        )
    if loss and "note" in loss:
        lines.append(f"loss curve: {loss['note']}")
    elif loss:
        rel = loss["relative_difference"]
        lines.append(
            f"loss curve: {loss['fast_config']} final loss {loss['fast_final_loss']:.4f} vs {loss['stock_config']} "
            f"{loss['stock_final_loss']:.4f} after {loss['updates']} updates ({100 * rel:+.2f} %); "
            f"target |difference| <= {100 * LOSS_TOLERANCE:.0f} %: {_verdict(-abs(rel), -LOSS_TOLERANCE)}"
        )
    return lines


def _verdict(got: float, target: float) -> str:
    return "n/a" if not math.isfinite(got) else "MET" if got >= target else "MISSED"


def markdown(doc: dict) -> str:
    """The ready-to-paste report: provenance, the table, the targets, the loss check."""
    cells = [[r["config"], r["layers"], r["precision"], _num(r["tokens_per_s"], "{:.0f}"),
              _num(r["ratio_to_stock"], "{:.3f}"), _num(r["peak_mem_gib"], "{:.2f}"), _num(r["mfu"], "{:.1%}"),
              r.get("note", "")] for r in doc["rows"]]  # fmt: skip
    header = ["config", "layers", "precision", "tokens/s", "x stock fp16", "peak GiB", "MFU", "note"]
    meta = doc["meta"]
    return "\n".join([
        f"GPU matrix: --max-tokens {meta['max_tokens']}, {meta['steps']} steps per trial, {meta['repeats']} "
        f"interleaved rounds, {meta['warmup']} warm-up steps.",
        harness.provenance(meta), "",
        "tokens/s: target tokens per second, median over rounds. x stock fp16: median of the per-round ratios to stock "
        "`transformer` in fp16 at the same depth and norm position (stock fp32 where fp16 was skipped). Peak: "
        "max_memory_allocated growth (CPU: RSS growth) while building and warming up. MFU: model FLOPs per second "
        f"over the dense bf16 peak ({doc['peak_note']}).", "",
        harness.markdown_table(header, cells, right=(1, 3, 4, 5, 6)), "",
        "Targets:", "", *[f"- {line}" for line in doc["targets"]],
    ])  # fmt: skip


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)
