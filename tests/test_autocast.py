"""``--task translation_deepinit --autocast-bf16``: forward and loss under bf16 autocast, fp32 weights.

On CPU ``torch.autocast("cpu", torch.bfloat16)`` runs the same code path as on GPU (matrix products in
bf16): the loss stays close to the fp32 loss, the weights, gradients and optimizer state stay fp32,
fairseq's own precision flags are refused, and fairseq-train runs with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

import pytest
import torch
from cli_fork import run_forked
from fairseq import options
from fairseq.sequence_generator import SequenceGenerator
from fairseq.tasks.translation import TranslationConfig

from conftest import TINY_DIMS, USER_DIR, make_dictionary
from fairseq_deepinit.training import autocast
from fairseq_deepinit.training.autocast import (
    AutocastConfigError,
    AutocastCriterion,
    TranslationDeepInitConfig,
    TranslationDeepInitTask,
    check_fp32_training,
    check_precision_flags,
)

PAD = 1


class PlainOptimizer:
    """What fairseq's trainer hands to train_step in fp32 training: ``backward`` is ``loss.backward``."""

    def backward(self, loss):
        loss.backward()


def build(*flags: str, autocast_bf16: bool = True, seed: int = 1):
    """Task, model and criterion exactly as fairseq-train builds them (arguments parsed with the task's)."""
    parser = options.get_training_parser()
    cli = ["/nonexistent", "--task", "translation_deepinit", "--arch", "deepinit_tiny", "-s", "src", "-t", "tgt"]
    cli += ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--dropout", "0", *flags]
    if autocast_bf16:
        cli.append("--autocast-bf16")
    args = options.parse_args_and_arch(parser, cli)
    d = make_dictionary(50)
    task = TranslationDeepInitTask(args, d, d)
    torch.manual_seed(seed)
    model = task.build_model(args)
    return task, model, task.build_criterion(args), args


def sample(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 54, (4, 9), generator=g)
    src[2, :4] = PAD  # left-padded source
    tgt = torch.randint(4, 54, (4, 7), generator=g)
    tgt[1, 5:] = PAD
    tgt[:, -1:].masked_fill_(tgt[:, -1:].ne(PAD), 2)  # eos
    prev = torch.cat([torch.full((4, 1), 2), tgt[:, :-1]], dim=1)
    net_input = {"src_tokens": src, "src_lengths": src.ne(PAD).sum(1), "prev_output_tokens": prev}
    ntokens = int(tgt.ne(PAD).sum())
    return {"id": torch.arange(4), "net_input": net_input, "target": tgt, "ntokens": ntokens, "nsentences": 4}


def test_option_is_a_task_field_and_composes_with_other_configs():
    fields = {f.name: f for f in dataclasses.fields(TranslationDeepInitConfig)}
    assert fields["autocast_bf16"].default is False
    assert {f.name for f in dataclasses.fields(TranslationConfig)} < set(fields)
    _, _, _, args = build()
    assert args.autocast_bf16 is True and args.task == "translation_deepinit"


def test_loss_close_to_fp32_and_weights_stay_fp32():
    results = {}
    for enabled in (False, True):
        task, model, criterion, _ = build(autocast_bf16=enabled)
        dtypes = []
        hook = model.decoder.output_projection.register_forward_hook(lambda m, i, o, seen=dtypes: seen.append(o.dtype))
        loss, sample_size, logs = task.train_step(sample(), model, criterion, PlainOptimizer(), update_num=0)
        hook.remove()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
        results[enabled] = (loss.detach(), grads, dtypes[0], sample_size)
    (l32, g32, dt32, n32), (l16, g16, dt16, n16) = results[False], results[True]
    assert dt32 == torch.float32 and dt16 == torch.bfloat16  # the logits really were computed in bf16
    assert l16.dtype == torch.float32 and n16 == n32
    # bf16 keeps 8 bits of mantissa: the loss moves, but by well under a percent
    assert l16 != l32 and abs(l16 - l32) / l32 < 1e-2
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0) > 0.99


def test_valid_and_inference_steps_run_under_autocast():
    task, model, criterion, _ = build()
    dtypes = []
    model.decoder.output_projection.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    loss, _, _ = task.valid_step(sample(), model, criterion)
    assert math.isfinite(loss.item()) and dtypes == [torch.bfloat16]
    assert not model.training
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=2, max_len_b=5)
    hyps = task.inference_step(gen, [model], {"net_input": sample()["net_input"]})
    assert len(hyps) == 4 and all(len(h) == 2 for h in hyps)
    assert set(dtypes[1:]) == {torch.bfloat16}
    # and nothing of it leaks out of the task: autocast is off again
    assert not torch.is_autocast_enabled("cpu")


def test_the_task_logs_once_whether_the_cpus_bf16_is_native(caplog):
    from fairseq_deepinit.training.cpu_bf16 import native_bf16

    task, model, criterion, _ = build()
    with caplog.at_level("INFO", logger="fairseq_deepinit.training.autocast"):
        task.valid_step(sample(), model, criterion)
        task.valid_step(sample(), model, criterion)
    lines = [r.getMessage() for r in caplog.records if "--autocast-bf16 on the CPU" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith(native_bf16()[1]), lines


def test_criterion_wrapper_is_transparent():
    _, _, criterion, _ = build()
    wrapped = AutocastCriterion(criterion, "cpu")
    assert wrapped.eps == criterion.eps and wrapped.padding_idx == criterion.padding_idx
    assert wrapped.logging_outputs_can_be_summed() == criterion.logging_outputs_can_be_summed()


@pytest.mark.parametrize("flag", ["fp16", "bf16", "memory_efficient_fp16", "memory_efficient_bf16", "amp"])
def test_fairseq_precision_flags_are_refused(flag):
    with pytest.raises(AutocastConfigError, match=f"does not combine with --{flag.replace('_', '-')}"):
        check_precision_flags(argparse.Namespace(**{flag: True}))
    check_precision_flags(argparse.Namespace(fp16=False, amp=False))  # nothing given: fine


def test_build_model_refuses_fp16():
    with pytest.raises(AutocastConfigError, match="does not combine with --fp16"):
        build("--fp16")
    build("--fp16", autocast_bf16=False)  # without --autocast-bf16 the task is fairseq's translation


def test_train_step_refuses_half_weights_and_fp16_optimizers():
    from fairseq.optim.amp_optimizer import AMPOptimizer
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    task, model, criterion, _ = build()
    for cls in (FP16Optimizer, AMPOptimizer):
        with pytest.raises(AutocastConfigError, match=f"got {cls.__name__}"):
            check_fp32_training(model, object.__new__(cls))
    model.half()
    with pytest.raises(AutocastConfigError, match="torch.float16 parameters"):
        task.train_step(sample(), model, criterion, PlainOptimizer(), update_num=0)
    assert autocast.TASK_NAME == "translation_deepinit"


def _losses(log: str) -> list[float]:
    return [float(m[1]) for m in re.finditer(r"\| train_inner \|.* loss=([-\d.e]+|nan|inf)", log)]


def test_cli_trains_with_autocast(synthetic_bin, tmp_path):
    common = [
        synthetic_bin, "--user-dir", USER_DIR, "--task", "translation_deepinit", "-s", "src", "-t", "tgt",
        "--arch", "deepinit_tiny", *TINY_DIMS, "--optimizer", "adam", "--lr", "3e-3", "--criterion",
        "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--dropout", "0.1", "--max-tokens", "1000",
        "--max-update", "30", "--save-dir", tmp_path / "ckpt", "--no-epoch-checkpoints", "--log-format", "simple",
        "--log-interval", "10", "--seed", "1", "--cpu", "--num-workers", "0", "--autocast-bf16",
    ]  # fmt: skip
    log = run_forked("train", *common, log=tmp_path / "train.log").stdout
    losses = _losses(log)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert re.search(r"valid on 'valid' subset \| loss [\d.]+", log)
    ckpt = torch.load(tmp_path / "ckpt" / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert all(t.dtype == torch.float32 for t in ckpt["model"].values() if t.is_floating_point())
    with pytest.raises(AssertionError, match="does not combine with --fp16"):
        run_forked("train", *common, "--fp16", log=tmp_path / "fp16.log")


def test_admin_task_profiles_in_fp32_then_trains_under_autocast(synthetic_bin, tmp_path):
    """``--task translation_admin`` takes ``--autocast-bf16`` too; omega is profiled before it applies."""
    log = run_forked(
        "train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation_admin", "-s", "src", "-t", "tgt",
        "--arch", "admin_iwslt_de_en", *TINY_DIMS, "--optimizer", "adam", "--lr", "1e-3", "--criterion",
        "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "1000", "--max-update", "20",
        "--save-dir", tmp_path / "ckpt", "--no-epoch-checkpoints", "--no-save", "--log-format", "simple",
        "--log-interval", "10", "--seed", "1", "--cpu", "--num-workers", "0", "--autocast-bf16",
        log=tmp_path / "admin.log",
    ).stdout  # fmt: skip
    assert "omega" in log
    losses = _losses(log)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
