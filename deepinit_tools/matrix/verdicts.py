"""The converged matrix's per-paper verdicts: each paper's claim checked on the cells (``report --converged``)."""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

from deepinit_tools.matrix import regimes as rg


def _get(cells: Dict[str, dict], method: str, depth: int, regime: str, seed: int = 1) -> dict | None:
    return cells.get(rg.Cell(depth, method, rg.canonical_regime(method, regime), seed).name)


def _ok(c: dict | None) -> bool | None:
    return None if c is None else c["status"] == "converged"


def _bleu(c: dict | None) -> float | None:
    return None if c is None or c["status"] != "converged" else c["test2016_bleu"]


def _all(*xs: bool | None) -> bool | None:
    return None if any(x is None for x in xs) else all(xs)


def _claims() -> List[Tuple[str, str, str, Callable[[Dict[str, dict]], bool | None]]]:
    """(paper, claim, rule in words, rule) — a rule returns None while a cell it needs is missing."""
    g = _get
    return [
        (
            "Xu et al. 2020",
            "deep Post-LN fails, Pre-LN trains",
            "Post-LN not converged at 18 or 36 layers; Pre-LN converged at both",
            _xu,
        ),
        (
            "Xu et al. 2020 (Lipschitz)",
            "Lipschitz init makes deep Post-LN converge",
            "converged at 18 and 36 layers",
            lambda c: _all(_ok(g(c, "lipschitz", 18, "paper")), _ok(g(c, "lipschitz", 36, "paper"))),
        ),
        (
            "Huang et al. 2020 (T-Fixup)",
            "trains deep without LayerNorm or warm-up, as well as Pre-LN",
            "converged at 18 and 36 layers without warm-up, test2016 BLEU >= Pre-LN's - 0.5 at both",
            lambda c: _all(
                _ok(g(c, "tfixup", 18, "paper")),
                _ok(g(c, "tfixup", 36, "paper")),
                _ge(_bleu(g(c, "tfixup", 18, "paper")), _bleu(g(c, "preln", 18, "paper"))),
                _ge(_bleu(g(c, "tfixup", 36, "paper")), _bleu(g(c, "preln", 36, "paper"))),
            ),
        ),
        (
            "Liu et al. 2020 (Admin)",
            "Admin trains deep Post-LN and matches or beats Pre-LN",
            "converged at 18 and 36 layers, test2016 BLEU >= Pre-LN's - 0.5 at both",
            lambda c: _all(
                _ok(g(c, "admin", 18, "paper")),
                _ok(g(c, "admin", 36, "paper")),
                _ge(_bleu(g(c, "admin", 18, "paper")), _bleu(g(c, "preln", 18, "paper"))),
                _ge(_bleu(g(c, "admin", 36, "paper")), _bleu(g(c, "preln", 36, "paper"))),
            ),
        ),
        (
            "Zhang et al. 2019 (DS-Init)",
            "DS-Init trains deep Post-LN",
            "converged at 18 and 36 layers",
            lambda c: _all(_ok(g(c, "dsinit", 18, "paper")), _ok(g(c, "dsinit", 36, "paper"))),
        ),
        (
            "Zhang et al. 2019 (MAtt)",
            "MAtt matches the standard decoder",
            "test2016 BLEU within 0.5 of DS-Init's at 6 and 18 layers",
            lambda c: _all(
                *(_near(_bleu(g(c, "dsinit_matt", d, "paper")), _bleu(g(c, "dsinit", d, "paper"))) for d in (6, 18))
            ),
        ),
        (
            "Nguyen & Salazar 2019 (TwT)",
            "PreNorm+ScaleNorm+FixNorm trains without warm-up and beats Post-LN",
            "converged without warm-up at 6 and 18 layers, 6-layer test2016 BLEU above Post-LN's",
            lambda c: _all(
                _ok(g(c, "twt", 6, "paper-nowarmup")),
                _ok(g(c, "twt", 18, "paper-nowarmup")),
                _ge(_bleu(g(c, "twt", 6, "paper")), _bleu(g(c, "postln", 6, "paper")), 0.0),
            ),
        ),
        (
            "Wang et al. 2022 (DeepNorm)",
            "stable Post-LN at any depth",
            "converged at 6, 18 and 36 layers",
            lambda c: _all(*(_ok(g(c, "deepnorm", d, "paper")) for d in (6, 18, 36))),
        ),
    ]


def _xu(c: Dict[str, dict]) -> bool | None:
    post = [_ok(_get(c, "postln", d, "paper")) for d in (18, 36)]
    pre = [_ok(_get(c, "preln", d, "paper")) for d in (18, 36)]
    if None in post + pre:
        return None
    return not all(post) and all(pre)


def _ge(a: float | None, b: float | None, slack: float = 0.5) -> bool | None:
    if a is None and b is None:
        return None
    if a is None or b is None:
        return b is None  # the baseline did not converge: the method wins
    return a >= b - slack


def _near(a: float | None, b: float | None) -> bool | None:
    return None if a is None or b is None else abs(a - b) <= 0.5


def verdict_table(cells: Dict[str, dict]) -> List[str]:
    lines = ["| paper | claim | rule (paper regime, seed 1) | verdict |", "|---|---|---|---|"]
    for paper, claim, words, rule in _claims():
        v = rule(cells)
        verdict = "not run yet" if v is None else "**reproduces**" if v else "**does not reproduce**"
        lines.append(f"| {paper} | {claim} | {words} | {verdict} |")
    return lines
