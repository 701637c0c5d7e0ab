"""Low precision on every path: checkpointed recompute under autocast, FixNorm in fp16/bf16, the guard's replay.

- ``--checkpoint-activations`` under bf16 autocast: a dtype audit (``deepinit_tools/harness/op_counters.py``)
  of the forward and backward passes finds every matrix product in bf16, the recompute included, and
  the gradients are bit for bit those without checkpointing, dropout on (the recompute replays the
  forward's masks, in the forward's dtypes); fairseq-train gives the same losses and weights.
- FixNorm's norm floor is valid in fp16 and bf16: a zero row stays finite, other rows match fp32.
- The divergence guard replays a failed update under the update's autocast state, so an overflow that
  only bf16 (or fp16) produces is found again and the layer is named.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from cli_fork import run_forked
from fairseq import utils

from conftest import TINY_DIMS, USER_DIR, build_model, make_dictionary, tiny_batch
from deepinit_tools.harness.op_counters import MatmulDtypeAudit  # noqa: E402
from fairseq_deepinit.errors import DivergenceError
from fairseq_deepinit.modules.fixnorm import FixNormEmbedding, FixNormOutputProjection, norm_floor
from fairseq_deepinit.training.activation_checkpoint import checkpoint_wrapper

BF16 = torch.bfloat16
# attention dropout apart: with it torch's CPU attention (F.scaled_dot_product_attention, which
# fairseq's F.multi_head_attention_forward path calls too) leaves its fused bf16 kernel for the math
# path (fp32 inside, counted as the one bf16 kernel CUDA runs: test_checkpointed_recompute_with_attention_dropout)
DROPOUT = ("--dropout", "0.2", "--activation-dropout", "0.2")
ATTENTION_DROPOUT = ("--attention-dropout", "0.2")
PRE = ("--encoder-normalize-before", "--decoder-normalize-before")
# one of each kind of layer and output: fairseq's attention, ReZero residual modules, TwT + FixNorm
# (FixNorm output projection), MAtt's AAN decoder layer, SDPA attention
CONFIGS = {
    "postln": (),
    "rezero": ("--init-scheme", "rezero"),
    "twt-fixnorm": (*PRE, "--init-scheme", "smallinit", "--norm-type", "scalenorm", "--fixnorm",
                    "--share-decoder-input-output-embed"),
    "matt-gated-aan": ("--decoder-layer-type", "matt", "--matt-self-branch", "gated-aan", "--matt-share-v"),
    "sdpa-preln": (*PRE, "--attention-impl", "sdpa"),
}  # fmt: skip


# ---- --checkpoint-activations under bf16 autocast -----------------------------------------------


def _build_lm(*cli: str):
    """A decoder-only ``deepinit_lm`` model as fairseq-train builds it, and a batch for it."""
    from fairseq import options
    from fairseq.tasks.language_modeling import LanguageModelingTask

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, ["/nonexistent", "--task", "language_modeling", "--arch", "deepinit_lm_tiny", *cli]
    )
    d = make_dictionary(50)
    torch.manual_seed(3)
    model = LanguageModelingTask(args, d, d).build_model(args)
    src = torch.randint(4, 54, (3, 9), generator=torch.Generator().manual_seed(0))
    return model, args, {"src_tokens": src, "src_lengths": torch.full((3,), 9)}


def _bf16_step(flags: tuple, checkpoint: bool, lm: bool = False):
    """One forward + backward under bf16 autocast with dropout 0.2: (loss, gradients, forward audit,
    backward audit)."""
    extra = ("--checkpoint-activations",) if checkpoint else ()
    if lm:
        model, args, batch = _build_lm(*DROPOUT, *flags, *extra)
    else:
        model, args = build_model("deepinit_tiny", *DROPOUT, *flags, *extra, seed=3)
        batch = tiny_batch()
    assert bool(args.checkpoint_activations) == checkpoint
    model.train()
    with torch.no_grad():  # non-zero ReZero scalars, so that every branch gets gradient
        for name, p in model.named_parameters():
            if name.endswith("alpha") and p.numel() == 1:
                p.fill_(0.5)
    torch.manual_seed(11)
    with MatmulDtypeAudit() as fwd, torch.autocast("cpu", dtype=BF16):
        out, _ = model(**batch)
        loss = out.float().pow(2).mean()
    with MatmulDtypeAudit() as bwd:
        loss.backward()  # outside autocast, as fairseq's train_step runs it
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, fwd, bwd


@pytest.mark.parametrize("config", [*CONFIGS, "lm-preln"])
def test_checkpointed_recompute_is_bf16_and_gives_the_same_gradients(config):
    """Every matrix product of forward and backward is bf16 with checkpointing, and the gradients equal
    those without it bit for bit.

    Exact equality is what the fix promises, not an approximation: the recompute runs the same ops in
    the same dtypes on the same inputs with the forward's dropout masks, and its backward is the
    backward of the plain run. The one reordering is where a tensor feeds several checkpointed layers
    (the encoder output feeds every decoder layer): its gradient is summed per layer first. Those
    summands are products of bf16 matrix products, so they carry 8 significant bits, and their fp32
    sum is exact in any order unless two of them are 2**16 apart; a tolerance would also hide the
    defects this test is for (an fp32 recompute, gradients summed in bf16, fresh dropout masks),
    whose differences are single bf16 ulps of some gradients.
    """
    lm = config == "lm-preln"  # the decoder-only language model (fairseq's language_modeling task)
    flags = ("--decoder-normalize-before",) if lm else CONFIGS[config]
    loss0, plain, fwd0, bwd0 = _bf16_step(flags, checkpoint=False, lm=lm)
    loss1, ckpt, fwd1, bwd1 = _bf16_step(flags, checkpoint=True, lm=lm)
    for audit in (fwd0, bwd0, fwd1, bwd1):
        assert set(audit.by_dtype()) == {BF16}, audit.summary()
    assert fwd1.counts == fwd0.counts  # the checkpointed forward runs the same products
    # the backward with checkpointing is the plain backward plus the layers' recompute
    assert all(bwd1.counts[k] >= n for k, n in bwd0.counts.items()), (bwd0.summary(), bwd1.summary())
    recomputed = sum(bwd1.by_dtype().values()) - sum(bwd0.by_dtype().values())
    assert 0 < recomputed < sum(fwd0.by_dtype().values())  # the output projection is not recomputed
    assert torch.equal(loss0, loss1)
    assert set(plain) == set(ckpt) and len(plain) > 10
    differ = [n for n in plain if not torch.equal(plain[n], ckpt[n])]
    assert not differ, differ
    assert sum(bool(g.abs().max() > 0) for g in plain.values()) > 0.8 * len(plain)


@pytest.mark.parametrize("config", ["postln", "sdpa-preln"])
def test_checkpointed_recompute_with_attention_dropout(config):
    """Attention dropout too: the same gradients bit for bit, every product in bf16, and the backward
    with checkpointing runs each attention call again (its recompute). With dropout torch's CPU
    attention leaves its fused bf16 kernel for the math path, which upcasts to fp32 inside; the audit
    counts each call as the one kernel CUDA runs, in its inputs' dtype, so an attention fed fp32 by our
    code would still show as fp32."""
    flags = (*CONFIGS[config], *ATTENTION_DROPOUT)
    _, plain, fwd0, bwd0 = _bf16_step(flags, checkpoint=False)
    _, ckpt, fwd1, bwd1 = _bf16_step(flags, checkpoint=True)
    assert fwd1.counts == fwd0.counts
    for audit in (fwd0, bwd0, fwd1, bwd1):
        assert set(audit.by_dtype()) == {BF16}, audit.summary()
    sdpa, sdpa_backward = ("scaled_dot_product_attention", BF16), ("scaled_dot_product_attention_backward", BF16)
    assert fwd0.counts[sdpa] >= 4 and bwd0.counts[sdpa] == 0  # every attention of both stacks
    assert bwd0.counts[sdpa_backward] == bwd1.counts[sdpa_backward] == fwd0.counts[sdpa]
    assert bwd1.counts[sdpa] == fwd0.counts[sdpa]  # the recompute
    assert [n for n in plain if not torch.equal(plain[n], ckpt[n])] == []


def test_recompute_replays_the_dropout_masks_under_autocast():
    """The test above can fail: without fairseq's RNG replay the recompute draws new dropout masks."""
    from fairseq.modules import checkpoint_activations as ca

    _, plain, _, _ = _bf16_step(CONFIGS["postln"], checkpoint=False)
    real = ca.utils.set_rng_state
    try:
        ca.utils.set_rng_state = lambda state: None
        _, broken, _, _ = _bf16_step(CONFIGS["postln"], checkpoint=True)
    finally:
        ca.utils.set_rng_state = real
    assert max((broken[n] - plain[n]).abs().max().item() for n in plain) > 1e-3


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, *, scale=None):
        return self.lin(x) * (1.0 if scale is None else scale), "non-tensor"


def test_wrapper_keeps_fairseqs_interface():
    """Keyword arguments, non-tensor outputs, CPU offload and fairseq's unwrap_checkpoint still work;
    the recompute follows the forward's state even when the backward runs under another one."""
    from fairseq.modules.checkpoint_activations import unwrap_checkpoint

    for offload in (False, True):
        torch.manual_seed(0)
        block = checkpoint_wrapper(_Block(), offload_to_cpu=offload)
        x = torch.randn(3, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=BF16):
            y, tag = block(x, scale=torch.tensor(2.0))
        assert tag == "non-tensor" and y.dtype == BF16
        with MatmulDtypeAudit() as bwd, torch.autocast("cpu", enabled=False):
            y.float().sum().backward()
        assert set(bwd.by_dtype()) == {BF16}, bwd.summary()
        ref = _Block()
        ref.load_state_dict(block.state_dict())
        x2 = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=BF16):
            y2, _ = ref(x2, scale=torch.tensor(2.0))
        y2.float().sum().backward()
        assert torch.equal(x.grad, x2.grad) and torch.equal(block.lin.weight.grad, ref.lin.weight.grad)
    with pytest.raises(ValueError, match="already wrapped"):
        checkpoint_wrapper(block)
    unwrap_checkpoint(block)
    assert not hasattr(block, "precheckpoint_forward") and block(x)[0].dtype == torch.float32


def _train_inner(log: str) -> list[str]:
    return [m[1] for m in re.finditer(r"\| train_inner \| (.*)", log)]


def test_cli_autocast_bf16_with_checkpoint_activations_matches_without(synthetic_bin, tmp_path):
    """fairseq-train --autocast-bf16 with and without --checkpoint-activations, dropout on: the same
    logged losses and gradient norms at every update, and the same weights bit for bit at the end."""
    logs, weights = [], []
    for extra in ((), ("--checkpoint-activations",)):
        save = tmp_path / f"ckpt{len(extra)}"
        log = run_forked(
            "train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation_deepinit", "--autocast-bf16",
            "-s", "src", "-t", "tgt", "--arch", "deepinit_tiny", *TINY_DIMS, *DROPOUT, *extra,
            "--optimizer", "adam", "--lr", "3e-3", "--criterion", "label_smoothed_cross_entropy",
            "--label-smoothing", "0.1", "--max-tokens", "1000", "--max-update", "6", "--disable-validation",
            "--save-dir", save, "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "1",
            "--seed", "1", "--cpu", "--num-workers", "0", log=tmp_path / f"train{len(extra)}.log",
        ).stdout  # fmt: skip
        assert bool(extra) == bool(re.search(r"checkpoint_activations\W+True", log))
        logs.append(_train_inner(log))
        weights.append(torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"])
    plain, ckpt = logs
    assert len(plain) == 6, plain
    losses = [float(re.search(r"loss=([-\d.e]+|nan|inf)", line)[1]) for line in plain]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    fields = [[f for f in line.split(" | ") if f.split("=")[0] in ("loss", "nll_loss", "gnorm")] for line in plain]
    assert fields == [
        [f for f in line.split(" | ") if f.split("=")[0] in ("loss", "nll_loss", "gnorm")] for line in ckpt
    ]
    assert weights[0].keys() == weights[1].keys()
    assert [k for k in weights[0] if not torch.equal(weights[0][k], weights[1][k])] == []


# ---- FixNorm's floor in fp16 and bf16 -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fixnorm_floor_is_valid_in_low_precision(dtype):
    """A zero row (not the padding row) stays finite and zero, with a finite gradient; every other row
    matches the fp32 computation within two roundings of ``dtype``.

    The low-precision result is ``fl(w / fl(||w||))`` (the norm is accumulated in fp32 by torch's
    reduction and rounded once): two roundings of at most ``eps/2`` each, so the relative error is at
    most ``eps`` (+ ``eps**2/4``), plus half a subnormal step for results below the smallest normal.
    The fp32 reference runs the same module on the same (already rounded) weights.
    """
    fi = torch.finfo(dtype)
    assert norm_floor(FixNormEmbedding.eps, dtype) > 0 and torch.tensor(norm_floor(1e-12, dtype), dtype=dtype) > 0
    assert math.isfinite(1.0 / torch.tensor(norm_floor(1e-12, dtype), dtype=dtype).item())
    assert norm_floor(1e-12, torch.float32) == 1e-12  # fp32: the released code's F.normalize eps

    torch.manual_seed(0)
    emb = FixNormEmbedding(40, 64, padding_idx=1)
    with torch.no_grad():
        emb.weight[5].zero_()  # a collapsed word
        emb.weight[7].mul_(0.05)  # a short row, its norm still above fp16's floor (2**-14)
    ref_emb = FixNormEmbedding(40, 64, padding_idx=1)
    emb = emb.to(dtype)
    with torch.no_grad():
        ref_emb.weight.copy_(emb.weight.float())
    out = emb.normalized_weight()
    ref = ref_emb.normalized_weight().detach()
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert torch.equal(out[5], torch.zeros_like(out[5])) and torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out.float(), ref, rtol=fi.eps * (1 + fi.eps), atol=fi.tiny * fi.eps / 2)

    proj = FixNormOutputProjection(emb).to(dtype)
    features = torch.randn(3, 4, 64).to(dtype).requires_grad_()
    logits = proj(features)
    assert torch.isfinite(logits).all()
    logits.float().mul(1e-3).sum().backward()
    assert torch.isfinite(emb.weight.grad).all() and torch.isfinite(features.grad).all()
    assert torch.equal(emb.weight.grad[1], torch.zeros_like(emb.weight.grad[1]))  # the padding row


# ---- the divergence guard replays under the update's precision ----------------------------------


def _guard_setup(*task_flags: str):
    """Task, model and diagnostics criterion as fairseq-train builds them, and an fp32 optimizer."""
    from fairseq import options
    from fairseq.tasks.translation import TranslationTask

    from fairseq_deepinit.training.autocast import TASK_NAME, TranslationDeepInitTask

    cli = ["/nonexistent", "--arch", "deepinit_tiny", "-s", "src", "-t", "tgt", *TINY_DIMS, "--dropout", "0",
           "--criterion", "label_smoothed_cross_entropy_diagnostics", "--label-smoothing", "0.1",
           *task_flags]  # fmt: skip
    args = options.parse_args_and_arch(options.get_training_parser(), cli)
    d = make_dictionary(50)
    task = (TranslationDeepInitTask if args.task == TASK_NAME else TranslationTask)(args, d, d)
    torch.manual_seed(1)
    model = task.build_model(args)
    criterion = task.build_criterion(args)
    return task, model, criterion, _Optimizer(list(model.parameters()))


class _Optimizer:
    """What fairseq's trainer uses of an fp32 optimizer around the backward: ``backward``,
    ``clip_grad_norm`` and ``zero_grad`` (fairseq/optim/fairseq_optimizer.py)."""

    def __init__(self, params: list) -> None:
        self.params = params

    def backward(self, loss) -> None:
        loss.backward()

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        return utils.clip_grad_norm_(self.params, max_norm, aggregate_norm_fn)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


class _UnderAutocast:
    """The criterion call under CPU autocast in ``dtype``, as fairseq's ``--amp`` runs it under CUDA
    fp16 autocast (fairseq/tasks/fairseq_task.py:531)."""

    def __init__(self, criterion, dtype: torch.dtype) -> None:
        self.criterion, self.dtype = criterion, dtype

    def __call__(self, model, sample):
        with torch.autocast("cpu", dtype=self.dtype):
            return self.criterion(model, sample)


def _sample():
    net_input = tiny_batch(bsz=4, src_len=7, tgt_len=6, seed=2)
    target = torch.roll(net_input["prev_output_tokens"], -1, dims=1)
    return {"id": torch.arange(4), "net_input": net_input, "target": target, "ntokens": target.numel(),
            "nsentences": 4}  # fmt: skip


# a value that fp32 holds and the low-precision dtype rounds to inf: bf16's largest finite number is
# 3.3895e38 and everything above 3.3961e38 rounds up to inf; fp16's is 65504
OVERFLOW = {torch.bfloat16: 3.4e38, torch.float16: 1e5}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_guard_replays_a_low_precision_overflow_and_names_the_layer(dtype):
    """fc1 of encoder layer 0 gets one hidden unit with bias OVERFLOW[dtype] and zero in- and outgoing
    weights: in fp32 the unit's activation is large but finite and fc2 multiplies it by 0, so the model
    is finite; in ``dtype`` the bias rounds to inf and inf * 0 makes the rest NaN. The update runs
    under autocast (bf16: the plugin's --autocast-bf16 task; fp16: the criterion under autocast, as
    --amp does), its gradients are NaN, and the guard's replay must run in ``dtype`` to find fc1."""
    if dtype == torch.bfloat16:
        task, model, criterion, optimizer = _guard_setup("--task", "translation_deepinit", "--autocast-bf16")
        step_criterion = criterion
    else:
        task, model, criterion, optimizer = _guard_setup("--task", "translation")
        step_criterion = _UnderAutocast(criterion, dtype)
    fc1, fc2 = model.encoder.layers[0].fc1, model.encoder.layers[0].fc2
    with torch.no_grad():
        fc1.weight[0].zero_()
        fc1.bias[0] = OVERFLOW[dtype]
        fc2.weight[:, 0].zero_()
    assert math.isinf(torch.tensor(OVERFLOW[dtype], dtype=dtype).item())
    sample = _sample()
    model.train()
    with torch.no_grad():  # the model is finite in fp32: a replay without autocast would find nothing
        assert torch.isfinite(model(**sample["net_input"])[0]).all()
    task.train_step(sample, model, step_criterion, optimizer, update_num=3)
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    grad_norm = optimizer.clip_grad_norm(0.0)  # what fairseq's trainer calls after the backward
    # its check fails (trainer.py:963-970): FloatingPointError, crash.pt, then it discards the update,
    # where the guard steps in (the diagnostics criterion's wrapped zero_grad)
    assert not torch.isfinite(grad_norm).all()
    with pytest.raises(DivergenceError) as err:
        optimizer.zero_grad()
    msg = str(err.value)
    name = str(dtype).replace("torch.", "")
    assert "training stopped at update 4: the gradient norm is nan" in msg, msg
    assert "First layer whose statistics went non-finite (forward order): encoder.layers.0 " in msg, msg
    assert "first module with a NaN/Inf output: encoder.layers.0.fc1;" in msg, msg
    assert f"replayed under autocast cpu {name}" in msg, msg
    assert "Non-finite weights" not in msg  # the weights are finite: only the low-precision forward overflows
