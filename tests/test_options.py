"""Start-up validation of the deepinit options: every bad input stops with a DeepInitConfigError that
says what to change, ``auto`` values resolve to what the scheme needs, and re-validating the
resolved arguments a checkpoint stores gives the same values (generate, resume)."""

from __future__ import annotations

import argparse
import copy
import pickle

import pytest

from conftest import USER_DIR, build_model, run_cli
from fairseq_deepinit.methods import INIT_SCHEMES as SCHEMES
from fairseq_deepinit.modules.norms import NORM_TYPES
from fairseq_deepinit.options import DeepInitConfigError, resolve_and_validate


def parse(*cli: str, arch: str = "deepinit_tiny") -> argparse.Namespace:
    """The namespace fairseq-train builds for these flags (before the model validates it)."""
    from fairseq import options

    import fairseq_deepinit  # noqa: F401

    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser, ["/nonexistent", "--task", "translation", "--arch", arch, "-s", "src", "-t", "tgt", *cli]
    )


def validated(*cli: str, arch: str = "deepinit_tiny") -> argparse.Namespace:
    args = parse(*cli, arch=arch)
    resolve_and_validate(args)
    return args


def reject(*cli: str, arch: str = "deepinit_tiny", **attrs) -> str:
    """The error message for these flags (``attrs`` are set on the namespace, as a checkpoint could)."""
    args = parse(*cli, arch=arch)
    for k, v in attrs.items():
        setattr(args, k, v)
    with pytest.raises(DeepInitConfigError) as info:
        resolve_and_validate(args)
    return str(info.value)


# ---------------------------------------------------------------------------------------------
# unknown values list the valid ones


@pytest.mark.parametrize(
    "flag,value,valid",
    [
        ("--init-scheme", "fixup", sorted(SCHEMES)),
        ("--norm-type", "batchnorm", NORM_TYPES),
        ("--residual-scale", "half", ("none", "deepnorm", "rezero")),
        ("--ds-init-variant", "tf", ("paper", "code")),
    ],
)
def test_unknown_choice_at_the_command_line_lists_valid_ones(flag, value, valid, capsys):
    cli = [flag, value] if flag != "--ds-init-variant" else ["--init-scheme", "ds-init", flag, value]
    with pytest.raises(SystemExit):
        parse(*cli)
    err = capsys.readouterr().err
    assert f"invalid choice: '{value}'" in err
    assert all(v in err for v in valid), err


@pytest.mark.parametrize(
    "attr,value,valid",
    [
        ("init_scheme", "fixup", sorted(SCHEMES)),
        ("norm_type", "batchnorm", NORM_TYPES),
        ("residual_scale", "half", ("none", "deepnorm", "rezero")),
        ("decoder_layer_type", "gru", ("standard",)),
    ],
)
def test_unknown_value_in_a_namespace_lists_valid_ones(attr, value, valid):
    # a namespace built in code or stored by an older checkpoint never went through argparse
    msg = reject(**{attr: value})
    assert f"--{attr.replace('_', '-')} {value!r}" in msg
    assert all(v in msg for v in valid), msg


def test_unknown_ds_init_variant_in_a_namespace():
    msg = reject("--init-scheme", "ds-init", ds_init_variant="tf")
    assert "--ds-init-variant 'tf'" in msg and "paper" in msg and "code" in msg


# ---------------------------------------------------------------------------------------------
# incompatible combinations


@pytest.mark.parametrize("norm", ["layernorm", "scalenorm", "rmsnorm"])
def test_tfixup_refuses_a_norm_unless_forced(norm):
    msg = reject("--init-scheme", "t-fixup", "--norm-type", norm)
    assert "--init-scheme t-fixup needs --norm-type none" in msg
    assert "--force-norm-with-scheme" in msg and f"got --norm-type {norm}" in msg
    args = validated("--init-scheme", "t-fixup", "--norm-type", norm, "--force-norm-with-scheme")
    assert args.norm_type == norm  # the ablation keeps what was asked for


def test_rezero_refuses_a_norm_and_deepnorm_needs_one():
    assert "--init-scheme rezero needs --norm-type none" in reject(
        "--init-scheme", "rezero", "--norm-type", "layernorm"
    )
    msg = reject("--init-scheme", "deepnorm", "--norm-type", "none")
    assert "--init-scheme deepnorm needs --norm-type layernorm or scalenorm or rmsnorm" in msg


@pytest.mark.parametrize("alpha", ["-0.1", "1.5", "nan"])
def test_ds_init_alpha_outside_unit_interval(alpha):
    msg = reject("--init-scheme", "ds-init", "--ds-init-alpha", alpha)
    assert "--ds-init-alpha must lie in [0, 1]" in msg and f"got {float(alpha)}" in msg


@pytest.mark.parametrize("alpha", ["0", "1", "0.25"])
def test_ds_init_alpha_inside_unit_interval(alpha):
    assert validated("--init-scheme", "ds-init", "--ds-init-alpha", alpha).ds_init_alpha == float(alpha)


@pytest.mark.parametrize("scheme", ["deepnorm", "rezero+postln"])
@pytest.mark.parametrize("flag", ["--encoder-normalize-before", "--decoder-normalize-before"])
def test_post_ln_scheme_with_pre_ln(scheme, flag):
    msg = reject("--init-scheme", scheme, flag)
    assert f"--init-scheme {scheme} is defined for Post-LN only" in msg
    assert "remove --encoder-normalize-before / --decoder-normalize-before" in msg


def test_deepnorm_residual_alone_with_pre_ln():
    msg = reject("--residual-scale", "deepnorm", "--encoder-normalize-before")
    assert "--residual-scale deepnorm is defined for Post-LN only" in msg


def test_scheme_residual_conflict():
    msg = reject("--init-scheme", "deepnorm", "--residual-scale", "none")
    assert "--init-scheme deepnorm needs --residual-scale deepnorm; got none" in msg
    msg = reject("--init-scheme", "rezero", "--residual-scale", "deepnorm")
    assert "needs --residual-scale rezero" in msg


def test_fixnorm_needs_shared_embeddings():
    msg = reject("--fixnorm")
    assert "--share-decoder-input-output-embed" in msg and "--share-all-embeddings" in msg
    assert validated("--fixnorm", "--share-decoder-input-output-embed").fixnorm is True
    assert validated("--fixnorm", "--share-all-embeddings").fixnorm is True


def test_fixnorm_with_adaptive_softmax_and_with_tfixup():
    msg = reject("--fixnorm", "--share-decoder-input-output-embed", "--adaptive-softmax-cutoff", "10,20")
    assert "adaptive" in msg and "drop one of them" in msg
    msg = reject("--fixnorm", "--share-decoder-input-output-embed", "--init-scheme", "t-fixup")
    assert "undo T-Fixup's embedding scaling" in msg and "drop --fixnorm" in msg


@pytest.mark.parametrize(
    "flags,owner",
    [
        (("--lipschitz-bias-free",), "lipschitz"),
        (("--ds-init-alpha", "0.5"), "ds-init"),
        (("--ds-init-variant", "code"), "ds-init"),
    ],
)
@pytest.mark.parametrize("scheme", ["xavier", "t-fixup", "lipschitz", "ds-init"])
def test_scheme_specific_flag_with_another_scheme(flags, owner, scheme):
    cli = ("--init-scheme", scheme, *flags)
    if scheme == owner:
        validated(*cli)
        return
    msg = reject(*cli)
    assert f"{flags[0]} only applies to --init-scheme {owner}, not {scheme}" in msg
    assert f"drop it or use --init-scheme {owner}" in msg


@pytest.mark.parametrize("eps", ["0", "-1e-5", "inf", "-inf", "nan"])
def test_norm_eps_must_be_finite_and_positive(eps):
    # inf trains a model whose every norm outputs 0 (it learns nothing, silently); nan only fails at the
    # first update with fairseq's generic non-finite gradient error
    msg = reject(f"--norm-eps={eps}")  # "=": argparse would read "-inf" as an option
    assert msg == (
        f"--norm-eps must be a finite number greater than 0 (default 1e-5), got {float(eps)}; "
        "drop --norm-eps or give e.g. --norm-eps 1e-6"
    )


@pytest.mark.parametrize("eps", ["1e-12", "1e-5", "0.1"])
def test_norm_eps_finite_and_positive_is_kept(eps):
    assert validated("--norm-eps", eps).norm_eps == float(eps)


def test_embedding_norm_needs_a_norm():
    msg = reject("--init-scheme", "t-fixup", "--layernorm-embedding")
    assert "--layernorm-embedding" in msg and "--norm-type is none" in msg


def test_errors_are_value_errors_and_stop_the_model_build():
    assert issubclass(DeepInitConfigError, ValueError)
    with pytest.raises(DeepInitConfigError, match="--force-norm-with-scheme"):
        build_model("deepinit_tiny", "--init-scheme", "t-fixup", "--norm-type", "layernorm")


# ---------------------------------------------------------------------------------------------
# resolution of ``auto`` and idempotence


@pytest.mark.parametrize(
    "scheme,norm,residual",
    [
        ("xavier", "layernorm", "none"),
        ("fairseq", "layernorm", "none"),
        ("t-fixup", "none", "none"),
        ("deepnorm", "layernorm", "deepnorm"),
        ("rezero", "none", "rezero"),
        ("rezero+postln", "layernorm", "rezero"),
    ],
)
def test_auto_resolves_to_the_scheme_needs(scheme, norm, residual):
    args = validated("--init-scheme", scheme)
    assert (args.norm_type, args.residual_scale) == (norm, residual)


def test_defaults_and_scheme_options_resolved():
    args = validated()
    assert args.init_scheme == "xavier" and args.norm_eps == 1e-5 and args.fixnorm is False
    assert args.lipschitz_bias_free is None and args.ds_init_variant is None and args.ds_init_alpha is None
    args = validated("--init-scheme", "ds-init")
    assert (args.ds_init_variant, args.ds_init_alpha) == ("paper", 1.0)
    assert validated("--init-scheme", "lipschitz").lipschitz_bias_free is False


IDEMPOTENT = [
    ((), "deepinit_tiny"),
    (("--init-scheme", "t-fixup"), "deepinit_tiny"),
    (("--init-scheme", "t-fixup", "--norm-type", "layernorm", "--force-norm-with-scheme"), "deepinit_tiny"),
    (("--init-scheme", "ds-init", "--ds-init-variant", "code", "--ds-init-alpha", "0.3"), "deepinit_tiny"),
    (("--init-scheme", "lipschitz", "--lipschitz-bias-free"), "deepinit_tiny"),
    (("--init-scheme", "deepnorm"), "deepinit_tiny"),
    (("--init-scheme", "rezero"), "deepinit_tiny"),
    ((), "twt_iwslt_de_en"),
    ((), "preln_wmt_en_de_12l"),
    ((), "tfixup_iwslt_de_en_200l"),
]


@pytest.mark.parametrize("cli,arch", IDEMPOTENT)
def test_resolve_and_validate_is_idempotent(cli, arch):
    args = validated(*cli, arch=arch)
    first = copy.deepcopy(vars(args))
    stored = pickle.loads(pickle.dumps(args))  # what a checkpoint keeps and generate/resume hands back
    resolve_and_validate(stored)
    assert vars(stored) == first
    resolve_and_validate(args)
    assert vars(args) == first
    for key in ("norm_type", "residual_scale"):
        assert first[key] != "auto"


def test_stored_args_rebuild_the_same_model():
    model, args = build_model("deepinit_tiny", "--init-scheme", "ds-init", "--ds-init-alpha", "0.5")
    from fairseq.tasks.translation import TranslationTask

    from conftest import make_dictionary

    d = make_dictionary()
    again = TranslationTask(args, d, d).build_model(pickle.loads(pickle.dumps(args)))
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in again.state_dict().items()}
    assert args.ds_init_alpha == 0.5 and args.ds_init_variant == "paper"


# ---------------------------------------------------------------------------------------------
# through the real CLI (one subprocess: it is slow)


@pytest.mark.slow
def test_cli_stops_with_the_message(tmp_path):
    for lang in ("src", "tgt"):
        (tmp_path / f"dict.{lang}.txt").write_text("".join(f"w{i} 1\n" for i in range(10)))
    proc = run_cli(
        "train", tmp_path, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
        "--arch", "tfixup_iwslt_de_en", "--norm-type", "layernorm", "--optimizer", "adam", "--lr", "1e-3",
        "--max-tokens", "100", "--cpu", "--save-dir", tmp_path / "ckpt", "--no-save",
        check=False, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    # one line, status 1, no traceback (fairseq_deepinit.errors); the model was never built
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout and "terminate called" not in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("fairseq-deepinit: error: ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    assert "--init-scheme t-fixup needs --norm-type none" in lines[0]
    assert "add --force-norm-with-scheme" in lines[0]


def test_normalize_before_without_a_norm_is_reported(caplog):
    """Pre-LN flags under T-Fixup change nothing (there is no norm to place): say so, do not refuse."""
    with caplog.at_level("WARNING", logger="fairseq_deepinit.options"):
        validated("--encoder-normalize-before", arch="tfixup_iwslt_de_en")
    assert "no effect with --norm-type none" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fairseq_deepinit.options"):
        validated(arch="tfixup_iwslt_de_en")
    assert "no effect" not in caplog.text


def test_option_table_is_every_model_option_with_type_default_and_choices():
    """options.option_table() (what a config dataclass is generated from) lists exactly the options
    add_model_args adds, each with a default of its type that its choices allow."""
    from fairseq_deepinit import options

    parser = argparse.ArgumentParser()
    options.add_model_args(parser)
    dests = {a.dest for a in parser._actions} - {"help", *options.ARCH_BOOL_FLAGS}
    table = options.option_table()
    assert sorted(r["name"] for r in table) == sorted(dests)
    for row in table:
        assert row["type"] in (bool, int, float, str), row
        if row["default"] is not None:
            assert isinstance(row["default"], row["type"]), row
        if row["choices"] is not None and row["default"] is not None:
            assert row["default"] in row["choices"], row
        # an axis selects the owning method, or a choice option of the method itself (--hyper-connections hc)
        own = {r["name"] for r in table if r["method"] == row["method"] and r["choices"]}
        selectors = ("init_scheme", "residual_scale", "decoder_layer_type", "norm_type", *own)
        assert row["help"] and (row["owner"] is None or row["owner"][0] in selectors), row
