"""gpu_readiness.py's targets and its table: one row per family, the verdict of every target."""

from __future__ import annotations

from typing import List

from deepinit_tools import harness

# families whose modules are stock fairseq's (only the initialisation differs): op target 1.02
INIT_ONLY = ("postln", "preln", "lipschitz", "dsinit")
# methods that move or rescale stock's computation without adding to it (a norm moved, Post-LN
# in the first layers, the branch multiplier fused into the residual add): the same op target
SAME_COMPUTE = ("reordered", "mixln", "depth_mup", "completep")
OP_TARGETED = INIT_ONLY + SAME_COMPUTE
OP_TARGET = 1.02
# the fp32-matmul cell of a family that refuses --checkpoint-activations (value residual): not applicable
REFUSED = "refused"
NORM_TARGETS = {"rmsnorm": 2, "scalenorm": 3}  # at most LayerNorm's kernels + this
# Admin profiling reads twice per run: its batch's cut (rows and widths) and the profile (numbers to log)
ADMIN_PROFILING_READS = 2

# DyT/Derf's alpha gradient is one full reduction (sum of dz * x over the batch) run as a dot in the
# norm's fp32 (fairseq_deepinit/modules/dyt.py _full_dot), as LayerNorm's backward reduces in fp32: not a
# matrix product of the model
NORM_REDUCTIONS = ("(_full_dot)",)


# mHC's mapping (fairseq_deepinit/modules/hyper.py, ManifoldHyperConnection.mappings) runs in fp32 by design (this
# project's choice, docs/schemes.md "Precision"): per connection one product forward (once more in the recompute of
# --checkpoint-activations) and two backward (its input's and its weight's gradients)
MAPPING_ORIGIN = "(mappings)"
MAPPING_MODULE = "ManifoldHyperConnection"


def model_products_off(audit, model=None, checkpoint: bool = False) -> dict:
    """``audit.off`` (origin -> count of products not in the audited dtype) less the norms' own reductions and,
    given the audited ``model``, less its mHC mappings' fp32 products when they are exactly the designed ones."""
    off = {origin: n for origin, n in audit.off.items() if not any(r in origin for r in NORM_REDUCTIONS)}
    n = 0 if model is None else sum(type(m).__name__ == MAPPING_MODULE for m in model.modules())
    forward = [o for o in off if MAPPING_ORIGIN in o]
    backward = [o for o in off if o.endswith("(backward)")]
    if not n or sum(off[o] for o in forward) != n * (2 if checkpoint else 1) or len(backward) != 1:
        return off
    if off[backward[0]] < 2 * n:
        return off
    out = {o: v for o, v in off.items() if o not in forward}
    out[backward[0]] -= 2 * n
    return {o: v for o, v in out.items() if v}


# --- the table ------------------------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("ok" if ok else "FAIL")


def meta_cell(meta: dict) -> tuple[str, bool]:
    if "error" in meta:
        return f"FAIL ({meta['error']})", False
    ok = meta.get("plugin_reads", 0) == 0
    return ("ok" if ok else f"FAIL ({meta['plugin_reads']} plugin reads)"), ok


def fmt_reads(row: dict) -> str:
    meta = row.get("meta", {})
    m = meta.get("reads", "?") if "error" not in meta else "?"
    stock = row.get("stock", {})
    text = f"{_num(m)} / {_num(row.get('cpu_reads', '?'))}"
    if stock:
        text += f" ({_num(stock.get('meta_reads', '?'))} / {_num(stock.get('cpu_reads', '?'))})"
    return text


def _num(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


def row_cells(row: dict) -> List[str]:
    meta_text, _ = meta_cell(row.get("meta", {}))
    reads_ok = all(
        isinstance(v, (int, float)) and v <= 1 for v in (row.get("cpu_reads"), row.get("meta", {}).get("reads"))
    )
    cells = [row["row"], meta_text, f"{fmt_reads(row)} {verdict(reads_ok)}"]
    if "ops" in row:
        ok = (row["op_ratio"] <= OP_TARGET) if row["op_targeted"] else None
        cells.append(f"{row['ops']} / {row['stock']['ops']} = {row['op_ratio']:.3f} {verdict(ok)}")
    else:
        cells.append("-")
    if "causal" in row and row["causal"] == REFUSED:  # the family refuses --attention-impl sdpa
        cells += [f"{REFUSED} -", f"{REFUSED} -"]
    if "causal" in row:
        for name in ("causal", "sdpa") if row["causal"] != REFUSED else ():
            n, total = row[name]
            cells.append(f"{n}/{total} {verdict(n == total) if total else '-'}")
        fp = row["fp32_mm"]
        ok = all(v == 0 or v == REFUSED for v in fp.values())
        sdpa = f"; sdpa {_num(fp['sdpa plain'])} / {_num(fp['sdpa checkpoint'])}" if "sdpa plain" in fp else ""
        cells.append(f"{_num(fp['plain'])} / {_num(fp['checkpoint'])}{sdpa} {verdict(ok)}")
    else:
        cells += ["-", "-", "-"]
    br = row.get("breaks")
    if br is None:
        cells.append("-")
    else:
        parts, ok = [], True
        for impl in ("fairseq", "sdpa"):
            if br[impl].get("refused"):
                parts.append(REFUSED)
                continue
            if "error" in br[impl]:
                parts.append(f"? ({br[impl]['error']})")
                ok = False
                continue
            by = br[impl]["by_origin"]
            parts.append(f"{by.get('plugin', 0)}/{by.get('fairseq', 0)}")
            ok = ok and by.get("plugin", 0) == 0
        cells.append(f"{'; '.join(parts)} {verdict(ok)}")
    return cells


HEADER = ["family", "meta (no plugin read)", "reads/step meta / cpu (stock) <= 1",
          f"ops plugin / stock (init-only, same computation <= {OP_TARGET})", "causal, no TxT (sdpa)",
          "self-attn on SDPA",
          "fp32 mm bf16 plain / ckpt; sdpa plain / ckpt = 0",
          "breaks plugin/fairseq: fairseq; sdpa attn (plugin 0)"]  # fmt: skip


def special_cells(row: dict) -> List[str]:
    meta_text, _ = meta_cell(row.get("meta", {}))
    meta = row.get("meta", {})
    if row["row"] == "admin profiling":
        # by design: the profiling batch's cut (rows and widths) and the profile's numbers, once per run
        ok = "error" not in meta and meta.get("plugin_reads", 9) <= ADMIN_PROFILING_READS
        meta_text = f"ok ({meta['plugin_reads']} reads per run)" if ok else meta_text
        reads_text = (f"{_num(meta.get('reads', '?'))} / {_num(row['cpu_reads'])} per run (cut, readout) "
                      f"<= {ADMIN_PROFILING_READS} {verdict(ok)}")  # fmt: skip
        return [row["row"], meta_text, reads_text, "-", "-", "-", "-", "-"]
    if row["row"].startswith("diagnostics"):
        ok = meta.get("reads", 9) <= 1 and row["cpu_reads"] <= 1 and meta.get("diagnostic_reads", 9) <= 1
        text = (
            f"{_num(meta.get('reads', '?'))} / {_num(row['cpu_reads'])}; diagnostic update: "
            f"{_num(meta.get('diagnostic_reads', '?'))} / {_num(row['cpu_diagnostic_reads'])} {verdict(ok)}"
        )
        return [row["row"], meta_text, text, "-", "-", "-", "-", "-"]
    return [
        row["row"],
        meta_text,
        f"{fmt_reads(row)} per step {verdict(row['cpu_reads'] <= 1)}",
        "-",
        "-",
        "-",
        "-",
        "-",
    ]


def cells(row: dict) -> List[str]:
    if "error" in row:
        return [row["row"], f"does not build: {row['error']}", "-", "-", "-", "-", "-", "-"]
    return special_cells(row) if row["kind"] == "special" else row_cells(row)


def markdown(rows: List[dict], norms: List[dict], meta: dict) -> str:
    body = [cells(r) for r in rows]
    lines = [harness.provenance(meta), "", harness.markdown_table(HEADER, body), ""]
    norm_rows = [[n["norm"], n["dtype"], n["kernels"], "-" if n["limit"] is None else f"<= {n['limit']}",
                  verdict(n["ok"])] for n in norms]  # fmt: skip
    lines += [harness.markdown_table(["norm", "dtype", "kernels fwd+bwd", "target", ""], norm_rows, right=(2,)), ""]
    notes = sorted(
        {f"{impl}: {line}" for r in rows for impl, br in r.get("breaks", {}).items() for line in br.get("plugin", [])}
    )
    if notes:
        lines += ["Graph breaks in the plugin's code:", ""] + [f"- `{n}`" for n in notes] + [""]
    return "\n".join(lines)
