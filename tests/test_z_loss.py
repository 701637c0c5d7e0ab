"""z-loss (``--z-loss``, ``--z-loss-multiplier``) on the plugin's criteria against the independent port of
OLMo-core's ``cross_entropy_loss`` (``tests/ports/z_loss.py``): the term fairseq's summed loss gains, its gradient,
the logged ``z_loss`` / ``z_loss_unscaled``, the ``loss`` / ``nll_loss`` split, translation and language models,
and the refusals. Float64 models compare to 1e-12; the float32 ``log Z`` to the float32 ``logsumexp`` within a
few float32 ulps of ``|log Z|``.
"""

from __future__ import annotations

import pytest
import torch
from fairseq import options, tasks
from fairseq.logging import metrics
from ports import z_loss as port

from conftest import TINY_DIMS, USER_DIR, make_dictionary, run_cli
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.training import loss_terms, z_loss

PAD = 1
TOL = dict(rtol=1e-12, atol=1e-12)
F32 = dict(rtol=16 * torch.finfo(torch.float32).eps, atol=0)  # a sum of positive float32 terms


def setup(kind: str, *cli: str, criterion: str = loss_terms.CRITERION_NAME):
    """``(model, criterion, args)`` built in-process as fairseq-train builds them, in float64."""
    import fairseq_deepinit  # noqa: F401

    if kind == "mt":
        argv = ["--task", "translation", "--arch", "preln_iwslt_de_en", "-s", "src", "-t", "tgt", *TINY_DIMS]
    else:
        argv = ["--task", "language_modeling", "--arch", "preln_lm_tiny"]
    args = options.parse_args_and_arch(options.get_training_parser(), ["/nonexistent", *argv, "--criterion",
                                                                       criterion, *cli])  # fmt: skip
    d = make_dictionary(50)
    task = tasks.TASK_REGISTRY[args.task](args, d, d)
    torch.manual_seed(1)
    model = task.build_model(args).double()
    return model, task.build_criterion(args), args


def sample(kind: str, seed: int = 0, bsz: int = 3, length: int = 6) -> dict:
    """A batch whose last row's target ends in padding."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(4, 54, (bsz, length), generator=g)
    target[-1, -2:] = PAD
    prev = torch.cat([torch.full((bsz, 1), 2), target[:, :-1]], dim=1).masked_fill(target.eq(PAD), PAD)
    if kind == "mt":
        src = torch.randint(4, 54, (bsz, 7), generator=g)
        net_input = {"src_tokens": src, "src_lengths": torch.full((bsz,), 7), "prev_output_tokens": prev}
    else:
        net_input = {"src_tokens": prev, "src_lengths": prev.ne(PAD).sum(1)}
    return {"net_input": net_input, "target": target, "ntokens": int(target.ne(PAD).sum()), "id": torch.arange(bsz)}


def leaf_loss(model, criterion, s: dict):
    """The criterion's summed loss on the model's logits (eval mode: no dropout) made a leaf."""
    model.eval()
    logits, extra = model(**s["net_input"])
    logits = logits.detach().requires_grad_()
    loss, nll = criterion.compute_loss(model, (logits, extra), s)
    loss.backward()
    return loss.detach(), nll.detach(), logits


@pytest.mark.parametrize("kind", ["mt", "lm"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_term_and_its_gradient_are_the_ports(kind, smoothing):
    """The term fairseq's summed loss gains is ``ports.z_loss.fairseq_sum`` and its gradient the port's; over the
    tokens it is OLMo-core's mean; ``nll_loss`` is unchanged. fairseq's log-probabilities are float32 whatever
    the model's dtype (``utils.log_softmax``), so the term carries float32 rounding (:data:`F32`)."""
    c = 0.05
    model, criterion, _ = setup(kind, "--z-loss", "--z-loss-multiplier", str(c), "--label-smoothing", str(smoothing))
    plain, criterion0, _ = setup(kind, "--label-smoothing", str(smoothing))
    plain.load_state_dict(model.state_dict())
    s = sample(kind)
    loss, nll, logits = leaf_loss(model, criterion, s)
    loss0, nll0, logits0 = leaf_loss(plain, criterion0, s)
    got, unscaled = criterion._terms_logged["z_loss"], criterion._terms_logged["z_loss_unscaled"]
    ref_logits = logits.detach().clone().requires_grad_()
    term = port.fairseq_sum(ref_logits, s["target"], PAD, c)
    term.backward()
    torch.testing.assert_close(got.double(), term.detach(), **F32)
    torch.testing.assert_close(got, c * unscaled, rtol=0, atol=0)
    torch.testing.assert_close((loss - loss0).double(), term.detach(), rtol=1e-5, atol=0)
    grad = logits.grad - logits0.grad
    torch.testing.assert_close(grad, ref_logits.grad, rtol=1e-5, atol=1e-5 * float(ref_logits.grad.abs().max()))
    assert torch.equal(nll, nll0)
    labels = s["target"].masked_fill(s["target"].eq(PAD), -100).view(-1)
    _, mean = port.cross_entropy_with_z_loss(logits.detach().view(-1, logits.size(-1)), labels, multiplier=c)
    torch.testing.assert_close(got.double() / s["ntokens"], mean, **F32)
    assert s["target"].eq(PAD).any() and float(term) > 0


def test_plain_cross_entropy_with_the_term_is_olmo_cores_loss():
    """``--label-smoothing 0``: the summed loss over the tokens is OLMo-core's ``ce_loss + z_loss`` (mean)."""
    model, criterion, _ = setup("lm", "--z-loss")
    s = sample("lm", seed=3)
    loss, _nll, logits = leaf_loss(model, criterion, s)
    labels = s["target"].masked_fill(s["target"].eq(PAD), -100).view(-1)
    ce, z = port.cross_entropy_with_z_loss(logits.detach().view(-1, logits.size(-1)), labels)
    torch.testing.assert_close((loss / s["ntokens"]).double(), ce + z, **F32)


@pytest.mark.parametrize("criterion", ["label_smoothed_cross_entropy_diagnostics", loss_terms.CRITERION_NAME])
def test_logged_values_are_olmo_cores(criterion):
    """``z_loss`` and ``z_loss_unscaled`` in the logging outputs (sums) and as metrics (means over the target
    tokens of two batches): OLMo-core's "Z loss" and "Z loss unscaled"; ``loss`` includes the term."""
    c = 1e-2
    model, crit, _ = setup("mt", "--z-loss", "--z-loss-multiplier", str(c), criterion=criterion)
    model.eval()  # the same logits in the criterion's forward and the port's
    logs, z_means, tokens = [], [], []
    for seed in (0, 1):
        s = sample("mt", seed=seed)
        with torch.no_grad():
            _loss, _size, log = crit(model, s)
            logits, _ = model(**s["net_input"])
        labels = s["target"].masked_fill(s["target"].eq(PAD), -100).view(-1)
        z_means.append(port.cross_entropy_with_z_loss(logits.view(-1, logits.size(-1)), labels, multiplier=c)[1])
        tokens.append(s["ntokens"])
        torch.testing.assert_close(log["z_loss"].double() / s["ntokens"], z_means[-1], **F32)
        torch.testing.assert_close(log["z_loss_unscaled"] * c, log["z_loss"], rtol=0, atol=0)
        logs.append(log)
    with metrics.aggregate(new_root=True) as agg:
        type(crit).reduce_metrics(logs)
        got = agg.get_smoothed_values()
    want = port.logged(sum(z * n for z, n in zip(z_means, tokens, strict=True)) / sum(tokens), c)
    assert got["z_loss"] == pytest.approx(want["Z loss"], rel=1e-5, abs=1e-6)  # logged rounded to 6 digits
    assert got["z_loss_unscaled"] == pytest.approx(want["Z loss unscaled"], rel=1e-5, abs=1e-3)  # to 3


def test_without_the_flag_the_criteria_log_no_term():
    model, crit, _ = setup("mt")
    _loss, _size, log = crit(model, sample("mt"))
    assert "z_loss" not in log and "z_loss_unscaled" not in log


@pytest.mark.parametrize("seed", [0, 1])
def test_float32_log_z_from_the_log_probabilities_is_logsumexp(seed):
    """``log Z = x_m - lprobs_m`` at the largest logit against float32 ``logsumexp``, for logits far from 0,
    and its gradient, the softmax."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(64, 500, generator=g) * 8 + 30 * (seed - 0.5)).requires_grad_()
    lprobs = torch.log_softmax(x, -1, dtype=torch.float32)
    z = z_loss.log_z(x, lprobs)
    ref = torch.logsumexp(x.detach().double(), -1)
    ulps = (z.detach().double() - ref).abs() / (torch.finfo(torch.float32).eps * ref.abs())
    assert ulps.max() <= 4
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.softmax(x.detach(), -1), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------- refusals


def _trainer(*cli: str, criterion: str):
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    model, crit, args = setup("lm", *cli, "--optimizer", "adam", "--lr", "1e-3", "--cpu", criterion=criterion)
    return Trainer(convert_namespace_to_omegaconf(args), None, model.float(), crit)


def test_a_criterion_that_drops_the_term_is_refused_before_training():
    with pytest.raises(DeepInitConfigError) as e:
        _trainer("--z-loss", criterion="label_smoothed_cross_entropy").optimizer  # noqa: B018
    msg = str(e.value)
    assert "--criterion label_smoothed_cross_entropy would leave it out" in msg and loss_terms.CRITERION_NAME in msg
    assert "\n" not in msg
    assert _trainer("--z-loss", criterion="cross_entropy_diagnostics").optimizer is not None
    assert _trainer(criterion="label_smoothed_cross_entropy").optimizer is not None


@pytest.mark.parametrize(
    "cli, says",
    [
        (("--z-loss-multiplier", "1e-5"), "--z-loss-multiplier needs --z-loss; add it or drop it"),
        (("--z-loss", "--z-loss-multiplier", "0"), "--z-loss-multiplier must be a number greater than 0 and at most 1"),
        (("--z-loss", "--z-loss-multiplier", "nan"), "--z-loss-multiplier must be a number greater than 0 and at most"),
        (
            ("--z-loss", "--z-loss-multiplier", "1e308"),
            "--z-loss-multiplier must be a number greater than 0 and at "
            "most 1, got 1e+308: the term is an auxiliary loss beside the cross-entropy (PaLM 0.0001, the default",
        ),
        (("--z-loss", "--z-loss-multiplier", "inf"), "--z-loss-multiplier must be a number greater than 0 and at most"),
        (
            ("--z-loss", "--adaptive-softmax-cutoff", "20", "--criterion", "adaptive_loss"),
            "--z-loss does not combine with --adaptive-softmax-cutoff (adaptive softmax never forms the full logits",
        ),
    ],
)
def test_refusals(cli, says):
    with pytest.raises(DeepInitConfigError) as e:
        setup("lm", *cli)
    assert says in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------ the CLI


@pytest.mark.slow
@pytest.mark.kernel_independent
def test_fairseq_train_logs_the_term(synthetic_bin, tmp_path):
    """Two updates of fairseq-train with --z-loss: the log line has z_loss and z_loss_unscaled, their ratio the
    multiplier."""
    log = run_cli("train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
                  "--arch", "preln_iwslt_de_en", *TINY_DIMS, "--criterion", loss_terms.CRITERION_NAME, "--z-loss",
                  "--z-loss-multiplier", "1e-3", "--optimizer", "adam", "--lr", "1e-3", "--cpu", "--max-tokens", "500",
                  "--max-update", "2", "--log-format", "json", "--log-interval", "1", "--num-workers", "0",
                  "--save-dir", tmp_path, "--no-save", "--disable-validation", forked=True).stdout  # fmt: skip
    import json

    lines = [json.loads(line[line.index("{") :]) for line in log.splitlines() if '"train_z_loss"' in line]
    assert lines, log[-2000:]
    for entry in lines:
        ratio = float(entry["train_z_loss"]) / float(entry["train_z_loss_unscaled"])
        assert ratio == pytest.approx(1e-3, rel=2e-3)
    assert "z-loss=0.001" in log
