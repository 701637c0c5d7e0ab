"""Every family and option variant keeps its state-dict keys, parameter order and fixed-seed outputs.

The fixture (``tests/fixtures/golden.json``, written by ``python -m tests.golden --write``; see
``tests/golden.py``) was computed before the model code was reorganised; the same
computations must give the same digests after. Keys and parameter order are checked on every machine;
the output digests (bit-exact float32 logits and gradients) on each kernel path the fixture has them for
(``golden.platform``: another vector width or BLAS code path rounds sums differently).
"""

from __future__ import annotations

import json

import golden
import pytest

FIXTURE = json.loads(golden.FIXTURE.read_text())
ORDER_KEYS = ("state_keys", "n_state_keys", "params", "n_params")
OUTPUT_KEYS = golden.OUTPUT_KEYS
RECORDED = golden.recorded_outputs(FIXTURE)


@pytest.fixture(scope="module")
def measured() -> dict:
    return golden.compute_all()


def test_fixture_covers_every_family_and_variant():
    assert sorted(name for name, *_ in golden.cases()) == sorted(FIXTURE["cases"])


@pytest.mark.parametrize("name", sorted(FIXTURE["cases"]))
def test_state_dict_keys_and_parameter_order(measured, name):
    got = {k: measured[name][k] for k in ORDER_KEYS}
    want = {k: FIXTURE["cases"][name][k] for k in ORDER_KEYS}
    assert got == want, f"{name}: state-dict keys or parameter order changed (python -m tests.golden --dump F)"


@pytest.mark.parametrize("name", sorted(FIXTURE["cases"]))
def test_outputs_bit_identical(measured, name):
    if name not in RECORDED:
        pytest.skip(f"{name}: no outputs recorded on this platform ({golden.platform()})")
    got = {k: measured[name][k] for k in OUTPUT_KEYS}
    want = RECORDED[name]
    assert got == want, f"{name}: outputs changed (loss/grad_norm as float.hex: {got} vs {want})"
