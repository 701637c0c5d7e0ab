"""The second probe round's bad input (tests/test_probes.py has the first): one line and exit status 1, or it works.

In process (the rule each check applies, at the point fairseq reaches it): the task against the model of a
checkpoint or a YAML and an unknown ``model._name`` (fairseq_deepinit/intercepts.py), embedding dimensions the
heads do not divide, a dictionary with a word twice, a validation sentence beyond the model's positions,
generation options that leave beam search nothing to do (fairseq_deepinit/input_checks.py), Mix-LN's
``--mixln-ratio`` given where it means nothing, the resume message's "unset", a checkpoint whose weights do not
fit the model after ``--allow-config-change`` (fairseq_deepinit/checkpoints/config_check.py).

As a user runs them (subprocesses, two at a time; ``deepinit-diagnose`` through its ``main``): fairseq-generate and
fairseq-eval-lm with the other kind of checkpoint, ``--beam 0``, ``--max-len-b 0``, a ``--path`` that is missing, a
folder or a bare state dict, a test sentence beyond ``--max-source-positions``; fairseq-train with a duplicate
dictionary word, embed dim 7, ``--fp16 --cpu``, ``--lr 1e30`` (diverges), a too-long validation sentence, Mix-LN's
ratio with ``--mixln-post-layers``, ``--allow-config-change`` that changes parameter shapes; fairseq-hydra-train
without ``task.data``, with an unknown ``model._name``, with a key no option of its node has (``+task.nosuch=1``,
the tfixup scheduler's ``decay_period`` left behind by ``lr_scheduler._name=inverse_sqrt``: hydra_plugins/);
deepinit-diagnose ``--checkpoint`` of a language model on translation data and of a folder.
"""

from __future__ import annotations

import argparse
import shutil
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, USER_DIR, build_model, make_dictionary, not_one_line, run_cli
from fairseq_deepinit import errors, input_checks, intercepts
from fairseq_deepinit.checkpoints import config_check
from fairseq_deepinit.diagnostics import diagnose

# --- in process -------------------------------------------------------------------------------------------------


def tasks_of_both_kinds():
    from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask
    from fairseq.tasks.translation import TranslationTask

    d = make_dictionary(20)
    mt = TranslationTask(argparse.Namespace(left_pad_source=True, left_pad_target=False), d, d)
    return mt, LanguageModelingTask(LanguageModelingConfig(), d)


@pytest.mark.parametrize(
    "arch, kind, message",
    [
        ("preln_lm_tiny", "mt", "the checkpoint holds a decoder-only language model (--arch preln_lm_tiny), which "
         "--task translation cannot run on source and target sentences; evaluate it with fairseq-eval-lm"),
        ("preln_iwslt_de_en", "lm", "the checkpoint holds an encoder-decoder (translation) model (--arch "
         "preln_iwslt_de_en), which --task language_modeling cannot run on one token stream"),
        ("tfixup_iwslt_de_e", "mt", "model._name tfixup_iwslt_de_e: no model or architecture of that name is "
         "registered (every fairseq-train --arch is a valid name; the plugin's need common.user_dir); did you mean "
         "tfixup_iwslt_de_en"),
    ],
)  # fmt: skip
def test_the_task_meets_the_model_it_builds(arch, kind, message):
    mt, lm = tasks_of_both_kinds()
    with pytest.raises(errors.DeepInitConfigError) as info:
        intercepts.check_task_and_model(arch, {"mt": mt, "lm": lm}[kind], from_checkpoint=True)
    assert message in errors.format_error(info.value)
    intercepts.check_task_and_model("preln_iwslt_de_en", mt, from_checkpoint=True)  # the right kind: built
    intercepts.check_task_and_model("transformer_lm", mt, from_checkpoint=True)  # fairseq's own: fairseq's rules


@pytest.mark.parametrize(
    "dims, message",
    [
        ({"encoder_embed_dim": 7, "encoder_attention_heads": 4}, "--encoder-embed-dim 7 is not divisible by "
         "--encoder-attention-heads 4 (each head gets embed-dim / heads dimensions); use a multiple of 4, e.g. 8"),
        ({"decoder_embed_dim": 30, "decoder_attention_heads": 4}, "--decoder-embed-dim 30 is not divisible by "
         "--decoder-attention-heads 4"),
        ({"decoder_embed_dim": 32, "decoder_attention_heads": 0}, "--decoder-embed-dim 32 with "
         "--decoder-attention-heads 0: both must be positive"),
    ],
)  # fmt: skip
def test_embedding_dimensions_the_heads_do_not_divide(dims, message):
    with pytest.raises(errors.DeepInitConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        intercepts.check_dimensions(argparse.Namespace(**dims))
    # every architecture of the plugin runs it after its defaults, as fairseq's parser calls it (here an LM's)
    from fairseq import options

    argv = ["/nonexistent", "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "preln_lm_tiny",
            "--decoder-embed-dim", "30"]  # fmt: skip
    with pytest.raises(errors.DeepInitConfigError, match="--decoder-embed-dim 30 is not divisible by --decoder-att"):
        options.parse_args_and_arch(options.get_training_parser(), argv)


def test_generation_options_that_leave_nothing_to_search():
    check = input_checks.check_generation
    for args, message in (
        (dict(beam=0), "--beam 0: beam search needs at least one hypothesis; give --beam 1 (greedy) or more"),
        (dict(max_len_b=0), "--max-len-b 0 (with --max-len-a 0) leaves no room for --min-len 1 output token(s)"),
        (dict(max_len_a=-1.0), "--max-len-a -1.0: the output length limit cannot grow negatively"),
    ):
        ns = SimpleNamespace(**{"beam": 5, "max_len_a": 0, "max_len_b": 200, "min_len": 1, **args})
        with pytest.raises(errors.DeepInitConfigError) as info:
            check(ns)
        assert message in str(info.value)
    check(SimpleNamespace(beam=1, max_len_a=1.2, max_len_b=0, min_len=1))  # scaled with the source: fine


def test_a_dictionary_with_a_word_twice(tmp_path):
    from fairseq.data import Dictionary

    path = tmp_path / "dict.src.txt"
    path.write_text("w1 5\nw2 4\nw1 3\n")
    with pytest.raises(errors.DataConfigError) as info:
        Dictionary.load(str(path))
    assert f"dictionary {path} lists the word 'w1' twice (lines 1, 3): every word once" in str(info.value)
    path.write_text("w1 5\nw2 4\nw1 3 #fairseq:overwrite\n")
    assert Dictionary.load(str(path)).index("w1") >= 4  # fairseq's own way out still works


def test_mixln_ratio_where_it_means_nothing():
    for cli, message in (
        (("--mixln-ratio", "0.5", "--mixln-post-layers", "1"), "--mixln-post-layers 1 sets k itself and "
         "--mixln-ratio 0.5 would compute it from the depth; give one of them"),
        (("--arch", "preln_iwslt_de_en", "--mixln-ratio", "0.5"), "--mixln-ratio needs --mix-ln; add it or drop"),
    ):  # fmt: skip
        arch, rest = (cli[1], cli[2:]) if cli[0] == "--arch" else ("mixln_iwslt_de_en", cli)
        with pytest.raises(errors.DeepInitConfigError, match=message):
            build_model(arch, "--encoder-layers", "2", "--decoder-layers", "2", *rest)
    build_model("mixln_iwslt_de_en", "--encoder-layers", "2", "--decoder-layers", "2", "--mixln-ratio", "0.5")


def test_the_resume_message_says_unset():
    diffs = [("mixln_post_layers", None, 1), ("fixnorm", False, True)]
    assert config_check._fmt_diffs(diffs) == "--mixln-post-layers unset -> 1, --fixnorm False -> True"


def test_allow_config_change_that_changes_parameter_shapes(tmp_path):
    old, _ = build_model("qknorm_iwslt_de_en", "--encoder-layers", "1", "--decoder-layers", "1")
    torch.save({"model": old.state_dict()}, tmp_path / "ckpt.pt")
    new, _ = build_model("qknorm_iwslt_de_en", "--encoder-layers", "1", "--decoder-layers", "1", "--qk-norm-type",
                         "layernorm")  # fmt: skip
    with pytest.raises(errors.ConfigChangeError) as info:
        config_check.check_parameters_fit(str(tmp_path / "ckpt.pt"), new)
    line = errors.format_error(info.value)
    assert "--allow-config-change cannot continue from" in line and "new: encoder.layers.0.self_attn" in line
    same, _ = build_model("qknorm_iwslt_de_en", "--encoder-layers", "1", "--decoder-layers", "1", "--dropout", "0.3")
    config_check.check_parameters_fit(str(tmp_path / "ckpt.pt"), same)  # same parameters: fairseq loads it


# --- as a user runs them ----------------------------------------------------------------------------------------

DIMS = ["--decoder-layers", "2", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
        "--decoder-attention-heads", "2"]  # fmt: skip
MT_DIMS = [*DIMS, "--encoder-layers", "2", "--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
           "--encoder-attention-heads", "2", "--share-all-embeddings"]  # fmt: skip
TRAIN = ["--user-dir", USER_DIR, "--optimizer", "adam", "--lr", "1e-3", "--cpu", "--num-workers", "0",
         "--log-format", "simple", "--seed", "1", "--no-epoch-checkpoints", "--max-update", "2"]  # fmt: skip
MT = [*TRAIN, "--task", "translation", "-s", "src", "-t", "tgt", "--max-tokens", "500"]
LM = [*TRAIN, "--task", "language_modeling", "--tokens-per-sample", "16", "--max-tokens", "128"]
GEN = ["--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt", "--cpu", "--max-tokens", "500",
       "--required-batch-size-multiple", "1"]  # fmt: skip
HYDRA = ["--config-dir", str(REPO / "examples" / "configs"), "--config-name", "tfixup_iwslt14_de_en",
         f"common.user_dir={USER_DIR}", "optimization.max_update=2", "dataset.disable_validation=true",
         "common.cpu=true", "task.source_lang=src", "task.target_lang=tgt", "++model.encoder_layers=2",
         "++model.decoder_layers=2", "++model.encoder_embed_dim=16", "++model.decoder_embed_dim=16"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(synthetic_bin, lm_bin, tmp_path_factory):
    """A translation and a language-model checkpoint (2 updates each), a bare state dict, a dictionary with a
    word twice, and a Mix-LN / QK-Norm run to resume."""
    root = tmp_path_factory.mktemp("bad_input")
    mt, lm, qk = root / "mt", root / "lm", root / "qk"
    run_cli("train", synthetic_bin, *MT, "--arch", "postln_iwslt_de_en", *MT_DIMS, "--save-dir", mt,
            "--disable-validation", forked=True)  # fmt: skip
    run_cli("train", lm_bin, *LM, "--arch", "preln_lm_tiny", *DIMS, "--save-dir", lm, "--disable-validation",
            forked=True)  # fmt: skip
    run_cli("train", synthetic_bin, *MT, "--arch", "qknorm_iwslt_de_en", *MT_DIMS, "--save-dir", qk,
            "--disable-validation", forked=True)  # fmt: skip
    state = torch.load(mt / "checkpoint_last.pt", weights_only=True)
    torch.save({k: v for k, v in state.items() if k not in ("args", "cfg")}, root / "bare.pt")
    dup = root / "dup"
    shutil.copytree(synthetic_bin, dup)
    for lang in ("src", "tgt"):
        path = dup / f"dict.{lang}.txt"
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join([*lines[:3], lines[0], *lines[3:]]))
    return SimpleNamespace(root=root, mt=mt / "checkpoint_last.pt", lm=lm / "checkpoint_last.pt", qk=qk, dup=dup)


def probes(trained, synthetic_bin, lm_bin) -> dict:
    """name -> (tool, arguments, what the one line says)."""
    mt, lm, root = trained.mt, trained.lm, trained.root
    return {
        "generate_lm_checkpoint": ("generate", [synthetic_bin, *GEN, "--path", lm],
                                   "the checkpoint holds a decoder-only language model (--arch preln_lm_tiny)"),
        "eval_lm_translation_checkpoint": ("eval_lm", [lm_bin, "--user-dir", USER_DIR, "--path", mt, "--cpu",
                                           "--max-tokens", "128", "--tokens-per-sample", "16"],
                                           "the checkpoint holds an encoder-decoder (translation) model"),
        "beam_0": ("generate", [synthetic_bin, *GEN, "--path", mt, "--beam", "0"], "--beam 0: beam search needs"),
        "max_len_b_0": ("generate", [synthetic_bin, *GEN, "--path", mt, "--max-len-b", "0"],
                        "--max-len-b 0 (with --max-len-a 0.0) leaves no room for --min-len 1"),
        "path_missing": ("generate", [synthetic_bin, *GEN, "--path", root / "nosuch.pt"],
                         f"checkpoint {root / 'nosuch.pt'} does not exist; give a checkpoint written by fairseq-train"),
        "path_folder": ("generate", [synthetic_bin, *GEN, "--path", root], f"checkpoint {root} is a folder"),
        "path_bare": ("generate", [synthetic_bin, *GEN, "--path", root / "bare.pt"],
                      "holds neither 'args' nor 'cfg' (the options fairseq-train saves with the weights)"),
        "generate_long_source": ("generate", [synthetic_bin, *GEN, "--path", mt, "--max-source-positions", "5"],
                                 "of the test split has 6 / 6 tokens, more than the model's positions 5 / 1024"),
        "interactive_beam_0": ("interactive", [synthetic_bin, *GEN, "--path", mt, "--beam", "0"],
                               "--beam 0: beam search needs"),
        "duplicate_word": ("train", [trained.dup, *MT, "--arch", "postln_iwslt_de_en", *MT_DIMS, "--save-dir",
                           root / "dup_ckpt"], f"dictionary {trained.dup / 'dict.src.txt'} lists the word"),
        "embed_dim_7": ("train", [synthetic_bin, *MT, "--arch", "postln_iwslt_de_en", *MT_DIMS, "--encoder-embed-dim",
                        "7", "--decoder-embed-dim", "7", "--save-dir", root / "e7"],
                        "--encoder-embed-dim 7 is not divisible by --encoder-attention-heads 2"),
        "lm_embed_dim_30": ("train", [lm_bin, *LM, "--arch", "preln_lm_tiny", *DIMS, "--decoder-embed-dim", "30",
                            "--decoder-attention-heads", "4", "--save-dir", root / "e30"],
                            "--decoder-embed-dim 30 is not divisible by --decoder-attention-heads 4"),
        "fp16_cpu": ("train", [synthetic_bin, *MT, "--arch", "postln_iwslt_de_en", *MT_DIMS, "--fp16", "--save-dir",
                     root / "fp16"], "--fp16 on --cpu: fairseq's FP16Optimizer keeps its flat fp32 master weights"),
        "lr_diverges": ("train", [synthetic_bin, *MT, "--arch", "postln_iwslt_de_en", *MT_DIMS, "--lr", "1e30",
                        "--save-dir", root / "diverged"], "training diverged: gradients are Nan/Inf (fairseq's"),
        "valid_long_sentence": ("train", [synthetic_bin, *MT, "--arch", "postln_iwslt_de_en", *MT_DIMS,
                                "--max-source-positions", "8", "--save-dir", root / "long"],
                                "of the valid split has 9 / 9 tokens, more than the model's positions 8 / 1024"),
        "mixln_ratio_and_k": ("train", [synthetic_bin, *MT, "--arch", "mixln_iwslt_de_en", *MT_DIMS, "--mixln-ratio",
                              "0.5", "--mixln-post-layers", "1", "--save-dir", root / "mixln"],
                              "--mixln-post-layers 1 sets k itself and --mixln-ratio 0.5"),
        "allow_config_change_shapes": ("train", [synthetic_bin, *MT, "--arch", "qknorm_iwslt_de_en", *MT_DIMS,
                                       "--qk-norm-type", "layernorm", "--allow-config-change", "--max-update", "4",
                                       "--save-dir", trained.qk],
                                       "--allow-config-change cannot continue from"),
        "hydra_no_data": ("hydra_train", [*HYDRA, f"checkpoint.save_dir={root / 'h1'}", f"hydra.run.dir={root / 'h1'}"],
                          "--task translation has no data folder: give the output of fairseq-preprocess"),
        "hydra_unknown_task_key": ("hydra_train", [*HYDRA, f"task.data={synthetic_bin}", "+task.nosuch=1",
                                   f"checkpoint.save_dir={root / 'h3'}", f"hydra.run.dir={root / 'h3'}"],
                                   "task.nosuch is not an option of --task translation (TranslationConfig)"),
        "hydra_scheduler_key_left": ("hydra_train", [*HYDRA, f"task.data={synthetic_bin}",
                                     "lr_scheduler._name=inverse_sqrt", f"checkpoint.save_dir={root / 'h4'}",
                                     f"hydra.run.dir={root / 'h4'}"],
                                     "lr_scheduler.decay_period is not an option of --lr-scheduler inverse_sqrt "
                                     "(InverseSquareRootLRScheduleConfig): a typo, or a key of the component the "
                                     "YAML named before lr_scheduler._name was changed. Drop it "
                                     "(~lr_scheduler.decay_period)"),
        "hydra_unknown_model": ("hydra_train", [*HYDRA, f"task.data={synthetic_bin}", "model._name=tfixup_iwslt_de_e",
                                f"checkpoint.save_dir={root / 'h2'}", f"hydra.run.dir={root / 'h2'}"],
                                "model._name tfixup_iwslt_de_e: no model or architecture of that name"),
    }  # fmt: skip


@pytest.mark.slow
def test_each_probe_is_one_line(trained, synthetic_bin, lm_bin):
    cases = probes(trained, synthetic_bin, lm_bin)
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {
            n: pool.submit(run_cli, tool, *args, check=False, cwd=trained.root) for n, (tool, args, _) in cases.items()
        }
        results = {n: f.result() for n, f in runs.items()}
    failed = not_one_line(results, {name: case[2] for name, case in cases.items()})
    assert not failed, "\n\n".join(failed)
    assert not (trained.root / "generate-test.txt").exists()


def _diagnose(capsys, *argv):
    try:
        status = diagnose.main([str(a) for a in argv])
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


@pytest.mark.slow
def test_diagnose_checkpoint_probes(trained, synthetic_bin, tmp_path, capsys):
    for checkpoint, message in (
        (trained.lm, f"--checkpoint {trained.lm} was trained with --task language_modeling, which cannot read "
         f"{synthetic_bin}"),
        (trained.root, f"--checkpoint {trained.root} is a folder: give a checkpoint file in it"),
        (trained.root / "nosuch.pt", f"--checkpoint {trained.root / 'nosuch.pt'} does not exist"),
        (trained.root / "bare.pt", f"checkpoint {trained.root / 'bare.pt'} holds neither 'args' nor 'cfg'"),
    ):  # fmt: skip
        status, err = _diagnose(capsys, synthetic_bin, "--checkpoint", checkpoint, "--output-dir", tmp_path / "out")
        lines = [ln for ln in err.splitlines() if ln.startswith("deepinit-diagnose: error: ")]
        assert status == 1 and len(lines) == 1 and message in lines[0], err[-2000:]
        assert not (tmp_path / "out").exists()
