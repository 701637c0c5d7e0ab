"""Learning-rate schedules, built through fairseq's registries exactly as fairseq-train builds them.

- ``tfixup``: T-Fixup's warmup-free decay lr_t = lr * sqrt(P / (P + t)) (Huang et al. 2020, sec. 4);
- ``reduce_lr_on_plateau`` with the flags docs/usage.md gives for Transformers without Tears'
  validation-based decay (Nguyen & Salazar 2019, sec. 4: warmup, then x0.8 when the dev score stalls).
"""

from __future__ import annotations

import math

import pytest
import torch


def build_scheduler(*flags: str, lr: str = "5e-4"):
    """(scheduler, optimizer) from fairseq-train flags: parser -> omegaconf -> registries, a real Adam."""
    from fairseq import optim, options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.optim import lr_scheduler

    import fairseq_deepinit  # noqa: F401  (registers the tfixup scheduler)

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        ["/nonexistent", "--task", "translation", "--arch", "deepinit_tiny", "--optimizer", "adam", "--lr", lr, *flags],
    )
    cfg = convert_namespace_to_omegaconf(args)
    optimizer = optim.build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(4))])
    return lr_scheduler.build_lr_scheduler(cfg.lr_scheduler, optimizer), optimizer


def lrs_of(optimizer) -> list[float]:
    return [g["lr"] for g in optimizer.optimizer.param_groups]


def test_tfixup_is_registered_with_its_class():
    from fairseq.optim.lr_scheduler import LR_SCHEDULER_REGISTRY

    from fairseq_deepinit.training.tfixup_schedule import TFixupSchedule

    assert LR_SCHEDULER_REGISTRY["tfixup"] is TFixupSchedule


def test_tfixup_values_by_hand():
    """P = 4000 (the paper's decay period), lr = 5e-4 (the released IWSLT script)."""
    sched, opt = build_scheduler("--lr-scheduler", "tfixup")
    assert sched.cfg.decay_period == 4000  # default
    assert lrs_of(opt) == [5e-4]  # no warmup: the first update already uses --lr
    # by hand: sqrt(4000/4000) = 1; sqrt(4000/8000) = 1/sqrt(2); sqrt(4000/16000) = 1/2; sqrt(4000/40000)
    by_hand = {0: 5e-4, 4000: 5e-4 / math.sqrt(2.0), 12000: 2.5e-4, 36000: 5e-4 * math.sqrt(0.1), 396000: 5e-5}
    for t, want in by_hand.items():
        got = sched.step_update(t)
        assert got == pytest.approx(want, rel=1e-12), t
        assert lrs_of(opt) == [pytest.approx(want, rel=1e-12)]  # what Adam actually uses


@pytest.mark.parametrize("period", [1, 400, 8000])
def test_tfixup_closed_form_at_several_updates(period):
    sched, opt = build_scheduler("--lr-scheduler", "tfixup", "--decay-period", str(period), lr="7e-4")
    for t in (0, 1, 7, 100, period, 3 * period, 123457):
        assert sched.step_update(t) == pytest.approx(7e-4 * math.sqrt(period / (period + t)), rel=1e-12)
    # at t = 3P the rate has halved, whatever P is
    assert sched.step_update(3 * period) == pytest.approx(3.5e-4, rel=1e-12)
    # monotone: never increases, never reaches 0
    values = [sched.step_update(t) for t in range(0, 50 * period, max(1, period // 3))]
    assert all(a > b > 0 for a, b in zip(values, values[1:], strict=False))


@pytest.mark.parametrize("period", ["0", "-5"])
def test_tfixup_rejects_non_positive_period(period):
    with pytest.raises(ValueError, match=r"--decay-period must be positive, got " + period):
        build_scheduler("--lr-scheduler", "tfixup", "--decay-period", period)


def test_tfixup_rejects_a_list_of_lr():
    with pytest.raises(ValueError, match=r"--lr-scheduler tfixup takes one --lr value, not a list"):
        build_scheduler("--lr-scheduler", "tfixup", lr="5e-4,1e-4")


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--decay-period", "1.5"), "invalid int value"),
        (("--warmup-updates", "4000"), "unrecognized arguments: --warmup-updates"),  # T-Fixup has no warmup
    ],
)
def test_tfixup_rejects_bad_flags_at_parse_time(flags, message, capsys):
    with pytest.raises(SystemExit):
        build_scheduler("--lr-scheduler", "tfixup", *flags)
    assert message in capsys.readouterr().err


TWT = ("--lr-scheduler", "reduce_lr_on_plateau", "--lr-shrink", "0.8", "--lr-patience", "3",
       "--warmup-updates", "4", "--warmup-init-lr", "1e-7")  # fmt: skip


def test_twt_plateau_flags_warmup_then_shrink_by_hand():
    """Linear warmup to --lr, then x0.8 once the validation loss has not improved for more than 3 evaluations.

    torch's ReduceLROnPlateau (behind fairseq's scheduler) tolerates ``patience`` evaluations without
    improvement and shrinks at the next one: with --lr-patience 3 the 4th stalled evaluation in a row.
    """
    sched, opt = build_scheduler(*TWT, lr="3e-4")
    assert lrs_of(opt) == [1e-7]
    step = (3e-4 - 1e-7) / 4
    for t in range(5):
        assert sched.step_update(t) == pytest.approx(1e-7 + t * step, rel=1e-12), t
    assert sched.step_update(5) == pytest.approx(3e-4)  # warmup over: --lr
    want = [3e-4, 3e-4, 3e-4, 3e-4, 3e-4, 2.4e-4, 2.4e-4, 2.4e-4, 2.4e-4, 1.92e-4, 1.92e-4]
    losses = [5.0, 4.0, 4.0, 4.1, 4.0, 4.2, 4.2, 4.0, 4.3, 4.0, 3.0]
    for epoch, (loss, lr) in enumerate(zip(losses, want, strict=True), start=1):
        assert sched.step(epoch, loss) == pytest.approx(lr, rel=1e-12), (epoch, loss)
        assert lrs_of(opt) == [pytest.approx(lr, rel=1e-12)]
    # the decayed rate is the scheduler's state: a resumed run continues from it
    assert sched.state_dict()["best"] == 3.0


def test_twt_plateau_on_bleu_maximises():
    """With --best-checkpoint-metric bleu --maximize-best-checkpoint-metric the decay follows dev BLEU."""
    sched, opt = build_scheduler(
        *TWT, "--eval-bleu", "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric", lr="3e-4"
    )
    for t in range(6):  # through the warmup, as fairseq-train does
        sched.step_update(t)
    for epoch, bleu in enumerate([20.0, 25.0, 24.0, 25.0, 23.0], start=1):
        assert sched.step(epoch, bleu) == pytest.approx(3e-4)
    assert sched.step(6, 25.0) == pytest.approx(2.4e-4)  # the 4th evaluation without a better BLEU


def test_twt_plateau_no_warmup_starts_at_lr():
    """TwT's no-warmup setting (lr 3e-4 from the first update): drop the warmup flags."""
    sched, opt = build_scheduler("--lr-scheduler", "reduce_lr_on_plateau", "--lr-shrink", "0.8", lr="3e-4")
    assert lrs_of(opt) == [3e-4]
    assert sched.step_update(1) == pytest.approx(3e-4)
