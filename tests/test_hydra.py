"""``fairseq-hydra-train``: the YAML path builds the model ``fairseq-train`` builds (fairseq_deepinit/model_config.py).

- every model flag of both models is a field of its generated config;
- a YAML ``model`` node and the equivalent flags give the same resolved options and bit-identical weights, for
  named architectures of every paper, options over an architecture, and the language model;
- a key that is no option, a value outside an option's choices or of the wrong type: one plugin error line;
- every paper configuration of ``examples/configs/`` trains 3 updates from its YAML (tiny dims on the command
  line), on a tiny Multi30k subset;
- checkpoints cross: a hydra checkpoint translates with ``fairseq-generate``, loads under torch's
  ``weights_only``, resumes with ``fairseq-train``, whose checkpoint resumes with ``fairseq-hydra-train``; a
  resume that changes the model is refused with one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from cli_fork import run_forked

import fairseq_deepinit  # noqa: F401  (registers the models)
from conftest import REPO, TINY_DIMS, USER_DIR, build_model, make_dictionary, read_multi30k, run_cli
from fairseq_deepinit.errors import DeepInitConfigError

CONFIGS = REPO / "examples" / "configs"
N_SYMBOLS = 50
# TINY_DIMS as hydra overrides (++: add the key, or replace the YAML's)
TINY = [f"++model.{TINY_DIMS[i][2:].replace('-', '_')}={TINY_DIMS[i + 1]}" for i in range(0, len(TINY_DIMS), 2)]
TINY_LM = ["++model.decoder_embed_dim=64", "++model.decoder_ffn_embed_dim=128", "++model.decoder_attention_heads=2"]
TINY_LM += ["++model.decoder_layers=2", "task.tokens_per_sample=64", "dataset.max_tokens=512"]


def _dims(flags: list) -> dict:
    return {flags[i][2:].replace("-", "_"): int(flags[i + 1]) for i in range(0, len(flags), 2)}


# ---- in process: the generated configs and the conversion ------------------------------------------------------


@pytest.mark.parametrize("model", ["deepinit", "deepinit_lm"])
def test_every_model_flag_is_a_config_field(model):
    from fairseq.models import MODEL_REGISTRY

    from fairseq_deepinit import options
    from fairseq_deepinit.model_config import CONFIGS as DATACLASSES

    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    MODEL_REGISTRY[model].add_args(parser)
    flags = {a.dest for a in parser._actions if a.dest != "help"}
    fields = {f.name for f in dataclasses.fields(DATACLASSES[model])}
    assert flags - fields == set()
    assert {row["name"] for row in options.option_table()} <= fields


def _hydra_model(arch: str, values: dict, task, seed: int = 1, task_values: dict | None = None):
    """Build the model as fairseq-hydra-train does: fairseq's ``build_model`` on the YAML's ``model`` node."""
    from fairseq import models
    from omegaconf import OmegaConf

    root = OmegaConf.create(
        {"task": task_values or {"max_source_positions": 1024, "max_target_positions": 1024}, "common": {"tpu": False}}
    )
    root.model = {"_name": arch, **values}
    torch.manual_seed(seed)
    model = models.build_model(root.model, task)
    model.hydra_node = root.model  # the node, as the trainer's cfg.model: the checkpoint stores it
    return model


def _same_model(cli_model, yaml_model, model_name: str) -> None:
    from fairseq_deepinit.model_config import CONFIGS as DATACLASSES

    a, b = cli_model.state_dict(), yaml_model.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    fields = [f.name for f in dataclasses.fields(DATACLASSES[model_name]) if not f.name.startswith(("_", "allow_"))]
    differ = {f: (getattr(cli_model.args, f, None), getattr(yaml_model.args, f, None)) for f in fields}
    assert {f: v for f, v in differ.items() if v[0] != v[1]} == {}
    # the node keeps the resolved model options (model_config.keep_resolved), as fairseq-train's Namespace does
    from fairseq_deepinit.checkpoints.config_check import CHECKED_OPTIONS

    checked = [f for f in CHECKED_OPTIONS if f in fields and hasattr(cli_model.args, f)]
    assert {f: yaml_model.hydra_node.get(f) for f in checked} == {f: getattr(cli_model.args, f) for f in checked}


# case -> (arch / _name, extra flags, the same options as YAML values)
TRANSLATION_CASES = {
    "tfixup": ("tfixup_iwslt_de_en", [], {}),
    "lipschitz": ("lipschitz_wmt_en_de", [], {}),
    "admin": ("admin_iwslt_de_en", [], {}),
    "dsinit_matt": ("dsinit_matt_iwslt_de_en_12l", [], {}),
    "twt": ("twt_wmt_en_de", [], {}),
    "deepnorm": ("deepnorm_wmt_en_de", [], {}),
    "options_over_plain": (
        "deepinit",
        ["--init-scheme", "ds-init", "--ds-init-alpha", "0.5", "--attention-impl", "sdpa"],
        {"init_scheme": "ds-init", "ds_init_alpha": 0.5, "attention_impl": "sdpa"},
    ),
    "gatedattn_elementwise": (
        "gatedattn_iwslt_de_en",
        ["--gated-attention-granularity", "elementwise", "--no-gated-attention-cross"],
        {"gated_attention_granularity": "elementwise", "gated_attention_cross": False},
    ),
    "sinks_sdpa": ("sinks_iwslt_de_en", ["--attention-impl", "sdpa"], {"attention_impl": "sdpa"}),
    "valueres_learned": ("valueres_iwslt_de_en", ["--value-residual-learned"], {"value_residual_learned": True}),
    "options_over_family": (
        "b2t_iwslt_de_en",
        ["--b2t-init-rescale", "none", "--norm-type", "rmsnorm", "--encoder-layers", "3"],
        {"b2t_init_rescale": "none", "norm_type": "rmsnorm", "encoder_layers": 3},
    ),
    "hyper_connections": (
        "preln_iwslt_de_en",
        ["--hyper-connections", "mhc", "--hc-streams", "2", "--mhc-sinkhorn-iters", "10"],
        {"hyper_connections": "mhc", "hc_streams": 2, "mhc_sinkhorn_iters": 10},
    ),
    "static_hc": ("hc_iwslt_de_en", ["--no-hc-dynamic"], {"hc_dynamic": False}),
    "attention_residuals": (
        "preln_iwslt_de_en",
        ["--attention-residuals", "block", "--attn-res-block-layers", "1", "--attn-res-eps", "1e-6"],
        {"attention_residuals": "block", "attn_res_block_layers": 1, "attn_res_eps": 1e-6},
    ),
}


@pytest.mark.parametrize("case", sorted(TRANSLATION_CASES))
def test_yaml_model_is_the_cli_model(case):
    from fairseq.tasks.translation import TranslationTask

    arch, flags, values = TRANSLATION_CASES[case]
    cli_model, args = build_model(arch, *TINY_DIMS, *flags, n_symbols=N_SYMBOLS)
    d = make_dictionary(N_SYMBOLS)
    yaml_model = _hydra_model(arch, {**_dims(TINY_DIMS), **values}, TranslationTask(args, d, d))
    _same_model(cli_model, yaml_model, "deepinit")


@pytest.mark.parametrize(
    "arch",
    ["deepnorm_lm_tiny", "deepinit_lm_tiny", "gatedattn_lm_tiny", "valueres_lm_tiny", "mhc_lm_tiny", "attnres_lm_tiny"],
)
def test_yaml_language_model_is_the_cli_model(arch):
    from fairseq import options
    from fairseq.tasks.language_modeling import LanguageModelingTask

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["/nonexistent", "--task", "language_modeling", "--arch", arch])
    d = make_dictionary(N_SYMBOLS)
    task = LanguageModelingTask(args, d, d)
    torch.manual_seed(1)
    cli_model = task.build_model(args)
    task_values = {"tokens_per_sample": args.tokens_per_sample, "add_bos_token": False, "max_target_positions": None}
    yaml_model = _hydra_model(arch, {}, task, task_values=task_values)
    _same_model(cli_model, yaml_model, "deepinit_lm")


@pytest.mark.parametrize("name", ["deepinit", "tfixup_iwslt_de_en"])
@pytest.mark.parametrize(
    "values, key",
    [
        ({"norm_typ": "rmsnorm"}, "model.norm_typ"),  # no such option
        ({"init_scheme": "tfixup"}, "model.init_scheme"),  # not one of the choices
        ({"encoder_layers": "many"}, "model.encoder_layers"),  # not an int
        ({"ds_init_alpha": "half"}, "model.ds_init_alpha"),  # not a float
    ],
)
def test_bad_model_node_is_one_plugin_error_line(name, values, key):
    from omegaconf import OmegaConf

    from fairseq_deepinit.model_config import as_namespace

    root = OmegaConf.create({"task": {"max_source_positions": 1024, "max_target_positions": 1024}})
    root.model = {"_name": name, **values}
    with pytest.raises(DeepInitConfigError) as e:
        as_namespace(root.model)
    assert str(e.value).startswith(key) and "\n" not in str(e.value)


# ---- fairseq-hydra-train runs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hydra_data(tmp_path_factory) -> dict:
    """The first 300 training and 50 validation sentences of Multi30k de-en, binarised with one joined dictionary
    (the paper configurations that share all embeddings need it), and the English side for the language model."""
    from conftest import MULTI30K

    if not (MULTI30K / "train.de.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (set MULTI30K_DIR)")
    root = tmp_path_factory.mktemp("hydra_data")
    raw = root / "raw"
    raw.mkdir()
    for split, out, n in (("train", "train", 300), ("val", "valid", 50)):
        for lang in ("de", "en"):
            (raw / f"{out}.{lang}").write_text("\n".join(read_multi30k(split, lang, n)) + "\n", encoding="utf-8")
    common = ["--trainpref", raw / "train", "--validpref", raw / "valid", "--workers", "1"]
    mt, lm = root / "bin", root / "lmbin"
    run_forked("preprocess", "-s", "de", "-t", "en", "--joined-dictionary", "--destdir", mt, *common, log=root / "p1")
    lm_text = ["--trainpref", raw / "train.en", "--validpref", raw / "valid.en", "--workers", "1"]
    run_forked("preprocess", "--only-source", "--destdir", lm, *lm_text, log=root / "p2")
    return {"mt": mt, "lm": lm, "root": root}


def hydra_train(config: str, data: Path, save_dir: Path, *overrides: str, updates: int = 3, log: Path):
    """``fairseq-hydra-train --config-dir examples/configs --config-name <config>`` with the test's overrides."""
    return run_forked(
        "hydra_train",
        "--config-dir",
        CONFIGS,
        "--config-name",
        config,
        f"task.data={data}",
        f"common.user_dir={USER_DIR}",
        f"checkpoint.save_dir={save_dir}",
        f"hydra.run.dir={save_dir}/hydra",
        f"optimization.max_update={updates}",
        "dataset.disable_validation=true",
        "common.log_format=simple",
        *overrides,
        log=log,
    )


# config -> (what its model's log line says, extra overrides); the plugin's task, criterion and optimizer that no
# YAML uses ride along on three runs (their options come from their own dataclasses, as fairseq's)
PAPER_CONFIGS = {
    "tfixup_iwslt14_de_en": ("init=t-fixup, norm=none", []),
    "lipschitz_wmt14_en_de": ("init=lipschitz", ["optimizer._name=adam_foreach"]),
    "admin_iwslt14_de_en": ("residual=admin", ["++model.admin_profile_max_tokens=512"]),
    "dsinit_matt_iwslt14_de_en": (
        "decoder-layer=matt",
        ["criterion._name=label_smoothed_cross_entropy_diagnostics", "++criterion.diagnostics_interval=1"],
    ),
    "twt_iwslt15_en_vi": ("norm=scalenorm", ["task.source_lang=de", "task.target_lang=en"]),
    "deepnorm_wmt17_en_de": ("init=deepnorm", ["task._name=translation_deepinit"]),
    "deepnorm_lm_48l": ("init=deepnorm", []),
}


def test_every_yaml_is_tested():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(PAPER_CONFIGS)


@pytest.fixture(scope="module")
def tfixup_run(hydra_data) -> tuple:
    """T-Fixup's YAML trained 3 updates with its checkpoint kept (for the checkpoint test): (save dir, log)."""
    save = hydra_data["root"] / "tfixup"
    out = hydra_train(
        "tfixup_iwslt14_de_en", hydra_data["mt"], save, *TINY, "dataset.max_tokens=1000", log=save.with_suffix(".log")
    )
    return save, out.stdout


@pytest.mark.parametrize("config", sorted(PAPER_CONFIGS))
def test_paper_config_trains_from_yaml(config, hydra_data, tmp_path, request):
    marker, extra = PAPER_CONFIGS[config]
    lm = "_lm_" in config
    tiny = TINY_LM if lm else [*TINY, "dataset.max_tokens=1000"]
    if config == "tfixup_iwslt14_de_en":
        out = request.getfixturevalue("tfixup_run")[1]
    else:
        data = hydra_data["lm" if lm else "mt"]
        out = hydra_train(config, data, tmp_path, "checkpoint.no_save=true", *tiny, *extra, log=tmp_path / "log").stdout
    assert re.search(r"deepinit: .*" + re.escape(marker), out), out[-2000:]
    assert "num_updates: 3 >= max_update: 3" in out, out[-2000:]


def test_z_loss_and_qk_clip_are_model_keys_of_a_yaml(hydra_data, tmp_path):
    """``--z-loss`` and ``--qk-clip`` as ``model:`` keys: the model's log line has both, the training log both
    terms' metrics."""
    out = hydra_train("deepnorm_lm_48l", hydra_data["lm"], tmp_path, "checkpoint.no_save=true", *TINY_LM,
                      "++model.z_loss=true", "++model.qk_clip=true", "++model.qk_clip_threshold=1.0",
                      "common.log_interval=1", log=tmp_path / "log").stdout  # fmt: skip
    assert "z-loss=0.0001" in out and "qk-clip(tau=1,alpha=0.5)" in out, out[-2000:]
    assert "z_loss_unscaled" in out and "qk_clip_heads" in out, out[-2000:]


def test_checkpoints_cross_the_two_paths(hydra_data, tfixup_run, tmp_path):
    from fairseq_deepinit.checkpoints.compat import disallowed_globals

    data, save = hydra_data["mt"], tfixup_run[0]
    ckpt = save / "checkpoint_last.pt"
    assert disallowed_globals(ckpt) == []  # the model config is a dict of plain values: weights_only loads it
    state = torch.load(ckpt, weights_only=True, map_location="cpu")
    assert state["cfg"]["model"]["_name"] == "tfixup_iwslt_de_en"

    gen = run_forked(
        "generate", data, "--user-dir", USER_DIR, "--path", ckpt, "--gen-subset", "valid", "--beam", "1",
        "--max-len-b", "5", "--max-tokens", "2000", "--required-batch-size-multiple", "1", log=tmp_path / "g",
    ).stdout  # fmt: skip
    assert "Translated 50 sentences" in gen

    train = [
        data, "--user-dir", USER_DIR, "--arch", "tfixup_iwslt_de_en", *TINY_DIMS, "--share-decoder-input-output-embed",
        "--dropout", "0.5", "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--weight-decay", "0.0001",
        "--lr", "0.0005", "--lr-scheduler", "tfixup", "--criterion", "label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--max-tokens", "1000", "--disable-validation", "--save-dir", save,
    ]  # fmt: skip
    out = run_forked("train", *train, "--max-update", "5", log=tmp_path / "t1").stdout
    assert "Loaded checkpoint" in out and "(epoch 1 @ 3 updates)" in out and "num_updates: 5 >= max_update: 5" in out

    out = hydra_train(
        "tfixup_iwslt14_de_en", data, save, *TINY, "dataset.max_tokens=1000", updates=7, log=tmp_path / "h2"
    )
    assert "(epoch 1 @ 5 updates)" in out.stdout and "num_updates: 7 >= max_update: 7" in out.stdout

    # a resume that changes the model: the plugin's one line under hydra too (hydra's own line first), status 1
    refused = run_cli(
        "hydra_train", "--config-dir", CONFIGS, "--config-name", "tfixup_iwslt14_de_en", f"task.data={data}",
        f"common.user_dir={USER_DIR}", f"checkpoint.save_dir={save}", f"hydra.run.dir={save}/hydra",
        "optimization.max_update=9", "dataset.disable_validation=true", *TINY, "dataset.max_tokens=1000",
        "++model.init_scheme=xavier", check=False,
    )  # fmt: skip
    assert refused.returncode == 1, refused.stdout[-2000:]
    assert "Traceback" not in refused.stdout, refused.stdout[-2000:]
    errors = [line for line in refused.stdout.splitlines() if "error:" in line]
    assert (
        errors == [errors[0]]
        and "fairseq-deepinit: error:" in errors[0]
        and "--init-scheme t-fixup -> xavier" in errors[0]
    )
