"""fairseq's own tests, run without the plugin and with it imported: no test may fail only with the plugin.

Importing the plugin (``--user-dir``) patches fairseq in the places :mod:`fairseq_deepinit.patches` lists;
those patches must change nothing for a stock fairseq model. This command runs a selection of fairseq's
own unit tests twice with pytest, in two fresh processes: once as fairseq ships, once after
``import fairseq_deepinit``, and compares the outcomes test by test (pytest's JUnit XML). It exits 1 when a
test passes without the plugin and fails (or errors) with it, and prints the counts of both runs.

fairseq's tests are not part of this project: fetch them at the version the pinned fairseq was released
from and pass their folder, e.g.::

    git -C <a fairseq clone> archive v0.12.3 tests | tar -x -C /tmp/fairseq-0.12.3
    python scripts/fairseq_tests.py /tmp/fairseq-0.12.3/tests --json fairseq_tests.json

The folder is linked into a temporary directory as ``tests/`` (fairseq's tests import ``tests.utils``), so
that a full fairseq checkout next to it never shadows the installed fairseq. ``--tests`` picks the files
(default :data:`DEFAULT_TESTS`: checkpoints, training, generation, EMA, the transformer, label smoothing,
fp16 optimizers, iterators, dictionaries, metrics); ``-k`` is pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List

from .paths import tools_env

DEFAULT_TESTS = (
    "test_checkpoint_utils.py",
    "test_checkpoint_utils_for_task_level_attributes.py",  # not in v0.12.3: skipped where absent
    "test_train.py",
    "test_sequence_generator.py",
    "test_sequence_scorer.py",
    "test_ema.py",
    "test_transformer.py",
    "test_label_smoothing.py",
    "test_fp16_optimizer.py",
    "test_memory_efficient_fp16.py",
    "test_inference_dropout.py",
    "test_valid_subset_checks.py",
    "test_iterators.py",
    "test_dictionary.py",
    "test_metrics.py",
    "test_data_utils.py",
    "test_lm_context_window.py",
    "test_average_checkpoints.py",
    "test_multihead_attention.py",
    "test_token_block_dataset.py",
    "test_dataclass_utils.py",
    "test_utils.py",
)
WITH_PLUGIN = "import sys, pytest, fairseq_deepinit; sys.exit(pytest.main(sys.argv[1:]))"
WITHOUT_PLUGIN = "import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))"
FAILED = ("failed", "error")


def outcomes(junit: Path) -> Dict[str, str]:
    """``{test id: passed | failed | error | skipped}`` from a pytest JUnit XML report."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(kinds[0], "") if kinds else "passed"
        out[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return out


def run(tests_dir: Path, files: List[str], plugin: bool, keyword: str | None, work: Path) -> Dict[str, str]:
    """One pytest run of ``files`` in a fresh interpreter; the outcome of every test it collected."""
    root = work / ("with" if plugin else "without")
    root.mkdir()
    (root / "tests").symlink_to(tests_dir.resolve(), target_is_directory=True)
    junit = root / "junit.xml"
    argv = [sys.executable, "-c", WITH_PLUGIN if plugin else WITHOUT_PLUGIN, "-q", "-p", "no:cacheprovider"]
    argv += ["--continue-on-collection-errors"]  # a file fairseq cannot import here fails in both runs alike
    argv += ["--junitxml", str(junit), "-o", "junit_family=xunit1", *(["-k", keyword] if keyword else [])]
    argv += [f"tests/{name}" for name in files]
    env = tools_env({**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    subprocess.run(argv, cwd=root, env=env, check=False)
    return outcomes(junit) if junit.is_file() else {}


def counts(results: Dict[str, str]) -> Dict[str, int]:
    return {kind: sum(1 for o in results.values() if o == kind) for kind in ("passed", "failed", "error", "skipped")}


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/fairseq_tests.py", description=__doc__.split("\n")[0])
    parser.add_argument("tests_dir", type=Path, help="the folder of fairseq's tests (its tests/, fetched)")
    parser.add_argument("--tests", nargs="+", help="test files of that folder to run (default: DEFAULT_TESTS present)")
    parser.add_argument("-k", dest="keyword", help="pytest's -k expression")
    parser.add_argument("--json", type=Path, help="write both runs' outcomes and the comparison here")
    args = parser.parse_args(argv)
    if args.tests is None:
        args.tests = [name for name in DEFAULT_TESTS if (args.tests_dir / name).is_file()]
    missing = [name for name in args.tests if not (args.tests_dir / name).is_file()]
    if missing or not args.tests:
        parser.error(
            f"{args.tests_dir} has no {', '.join(missing) or 'test'}; pass fairseq's tests/ folder (see --help)"
        )
    with tempfile.TemporaryDirectory(prefix="fairseq-tests-") as work:
        without = run(args.tests_dir, args.tests, False, args.keyword, Path(work))
        with_plugin = run(args.tests_dir, args.tests, True, args.keyword, Path(work))
    only_with = sorted(t for t, o in with_plugin.items() if o in FAILED and without.get(t) == "passed")
    fixed = sorted(t for t, o in without.items() if o in FAILED and with_plugin.get(t) == "passed")
    print(f"without the plugin: {counts(without)}")
    print(f"with the plugin:    {counts(with_plugin)}")
    print(f"fail only with the plugin: {len(only_with)}" + "".join(f"\n  {t}" for t in only_with))
    if fixed:
        print(f"fail only without the plugin: {len(fixed)}" + "".join(f"\n  {t}" for t in fixed))
    if args.json:
        report = {"without": without, "with": with_plugin, "only_with_plugin": only_with, "only_without": fixed}
        args.json.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    if not without or not with_plugin:
        print("a run collected no test (see its output above)", file=sys.stderr)
        return 2
    return 1 if only_with else 0


if __name__ == "__main__":
    sys.exit(main())
