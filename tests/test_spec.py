"""The resolved model spec (fairseq_deepinit/spec.py, resolve.py) and the declarations' checker (checks.py).

- ``resolve(args)`` reads the options and changes none of them, for every family of both models; what
  ``store`` then writes is what the build stores (fairseq's normalize-before booleans derived from the stacks);
- the spec's fields: each layer's placement (Mix-LN), the residual scaling's constants per stack (DeepNorm,
  depth-muP), no encoder for a language model, only the methods that are on in ``features``;
- a conflict between two declarations names both flags; a method's option given while it is off is refused;
- no method module imports another method's module;
- every record's ``validate`` takes the options and the spec only (:class:`~fairseq_deepinit.methods.record.Validate`).
"""

from __future__ import annotations

import argparse
import ast
import copy
import inspect

import pytest

from conftest import REPO
from fairseq_deepinit.architectures import FAMILIES
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.lm.architectures import LM_FAMILIES
from fairseq_deepinit.methods.deepnorm import deepnorm_alpha
from fairseq_deepinit.modules.residual import depth_branch_multiplier
from fairseq_deepinit.modules.stacks import DECODER, DECODER_ONLY, ENCODER
from fairseq_deepinit.resolve import resolve, store


def parse(arch: str, *cli: str, lm: bool = False) -> argparse.Namespace:
    from fairseq import options

    task = ["--task", "language_modeling"] if lm else ["--task", "translation", "-s", "src", "-t", "tgt"]
    args = options.parse_args_and_arch(options.get_training_parser(), ["/nonexistent", *task, "--arch", arch, *cli])
    if lm:
        args.encoder_layers = 0  # what the language model's build stores (lm/model.py)
    return args


@pytest.mark.parametrize("lm", [False, True], ids=["mt", "lm"])
def test_resolve_reads_and_store_writes(lm):
    families = LM_FAMILIES if lm else FAMILIES
    for family in families:
        args = parse(f"{family}_lm_tiny" if lm else f"{family}_iwslt_de_en", lm=lm)
        before = copy.deepcopy(vars(args))
        spec = resolve(args)
        assert vars(args) == before, family  # nothing changed by the resolution
        store(spec, args)
        assert {k: getattr(args, k) for k in spec.options} == dict(spec.options), family
        for stack in spec.stacks:
            assert getattr(args, f"{stack.kind.stack}_normalize_before") == (stack.placement != "post"), family
        assert resolve(args) == spec, family  # what a checkpoint stores resolves to the same spec


def test_the_spec_of_mixln_deepnorm_depth_mup_and_a_language_model():
    mixln = resolve(parse("mixln_iwslt_de_en", "--encoder-layers", "8", "--decoder-layers", "4"))
    assert mixln.encoder.placements == ("post", "post") + ("pre",) * 6 and mixln.encoder.placement == "pre"
    assert mixln.decoder.placements == ("post",) + ("pre",) * 3 and mixln.decoder.kind == DECODER
    assert set(mixln.features) == {"mixln"} and mixln.features["mixln"].mixln_ratio == 0.25

    deepnorm = resolve(parse("deepnorm_iwslt_de_en", "--encoder-layers", "6", "--decoder-layers", "3"))
    assert deepnorm.residual == "deepnorm" and deepnorm.encoder.placements == ("post",) * 6
    assert deepnorm.encoder.residual_constant == deepnorm_alpha(ENCODER, 6, 3)
    assert deepnorm.decoder.residual_constant == deepnorm_alpha(DECODER, 6, 3)

    completep = resolve(parse("completep_lm_tiny", "--decoder-layers", "12", lm=True))
    assert completep.encoder is None and completep.decoder.kind == DECODER_ONLY and completep.residual == "depth-mup"
    assert completep.decoder.residual_constant == depth_branch_multiplier(12, 6, 1.0)
    assert completep.layers("encoder") == 0 and completep.features["depth_mup"].depth_mup_source == "paper"

    plain = resolve(parse("deepinit_tiny"))
    assert dict(plain.features) == {} and plain.norm.type == "layernorm" and plain.residual == "none"


@pytest.mark.parametrize(
    "arch, cli, both",
    [
        ("resi_dual_iwslt_de_en", ["--scale-resids"], ("--residual-scale resi-dual", "--scale-resids")),
        ("lnscale_iwslt_de_en", ["--depth-mup"], ("--layernorm-scaling", "--depth-mup")),
        ("subln_iwslt_de_en", ["--init-scheme", "t-fixup"], ("--subln", "--init-scheme t-fixup")),
        ("reordered_iwslt_de_en", ["--subln"], ("--subln", "--norm-placement reordered")),
        ("mixln_iwslt_de_en", ["--depth-mup"], ("--depth-mup", "--mix-ln")),
        ("preln_iwslt_de_en", ["--qk-norm-scope", "proj"], ("--qk-norm-scope", "--qk-norm")),
    ],
)
def test_a_conflict_names_both_flags_in_one_line(arch, cli, both):
    with pytest.raises(DeepInitConfigError) as e:
        resolve(parse(arch, *cli))
    assert all(flag in str(e.value) for flag in both) and "\n" not in str(e.value), str(e.value)


def test_no_method_module_imports_another():
    folder = REPO / "fairseq_deepinit" / "methods"
    methods = {p.stem for p in folder.glob("*.py")} - {"__init__", "record", "pointwise", "exporting"}
    for path in sorted(folder.glob("*.py")):
        if path.stem == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = {node.module} if node.module else {a.name for a in node.names}
                assert not names & methods, f"methods/{path.name} imports {names & methods}"


def test_every_validate_takes_the_options_and_the_spec():
    from fairseq_deepinit.methods import METHODS
    from fairseq_deepinit.methods.record import Method

    assert Method.__dataclass_fields__["validate"].type == "Validate | None"
    hooks = {m.name: list(inspect.signature(m.validate).parameters) for m in METHODS.values() if m.validate}
    assert hooks and {name: len(params) for name, params in hooks.items()} == dict.fromkeys(hooks, 2), hooks
