"""``--optimizer adam_foreach`` (fairseq_deepinit/training/adam_foreach.py) against fairseq's own Adam.

The reference is ``fairseq.optim.adam.Adam.step`` itself, run on the same parameters and gradients.
Both apply the same element-wise operations in the same order; the CPU ``_foreach`` kernels apply
the per-tensor ones, so the two agree to the last bit here. The tolerances allow what a fused
multi-tensor kernel (CUDA) may do differently: a contraction of a multiply and an add, about one
rounding (2^-24 relative in fp32, 2^-53 in fp64) per operation and step.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from fairseq.optim.adam import Adam as FairseqAdamImpl

import fairseq_deepinit  # noqa: F401  (registers the optimizer)
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.training.adam_foreach import AdamForeach

SHAPES = [(7, 5), (5,), (3, 4, 2), (1,), (64,)]
STEPS = 12


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(dtype)) for s in SHAPES]


def _run(opt_cls, params, grads, **kw):
    opt = opt_cls(params, **kw)
    for step_grads in grads:
        for p, gr in zip(params, step_grads, strict=True):
            p.grad = gr.to(p.dtype)
        opt.step()
    return opt


def _grads(seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # gradient scales over 6 decades, and one step with a zero gradient
    out = [[torch.randn(s, generator=g, dtype=torch.float64) * 10.0 ** -(k % 6) for k, s in enumerate(SHAPES)]
           for _ in range(STEPS)]  # fmt: skip
    out[3] = [torch.zeros_like(t) for t in out[3]]
    return out


@pytest.mark.parametrize("dtype,rel", [(torch.float64, 1e-13), (torch.float32, 4e-6)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_same_parameters_and_state_as_fairseqs_adam(dtype, rel, weight_decay, amsgrad):
    grads = _grads()
    kw = dict(lr=3e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=weight_decay, amsgrad=amsgrad)
    ref_params, new_params = _params(dtype), _params(dtype)
    ref = _run(FairseqAdamImpl, ref_params, grads, **kw)
    new = _run(AdamForeach, new_params, grads, **kw)
    for a, b, start in zip(ref_params, new_params, _params(dtype), strict=True):
        assert torch.allclose(b, a, rtol=rel * STEPS, atol=0), (a - b).abs().max()
        assert not torch.equal(a, start)  # the update did something
    for a, b in zip(ref_params, new_params, strict=True):
        sa, sb = ref.state[a], new.state[b]
        assert sa["step"] == sb["step"] == STEPS
        for k in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            assert torch.allclose(sb[k], sa[k], rtol=rel * STEPS, atol=0), k


def test_half_precision_parameters_update_through_an_fp32_copy_like_fairseqs():
    """The memory-efficient fp16 path: fp16 weights, fp32 state, fp32 arithmetic, rounded back."""
    grads = _grads()
    kw = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    ref_params, new_params = _params(torch.float16), _params(torch.float16)
    ref = _run(FairseqAdamImpl, ref_params, grads, **kw)
    new = _run(AdamForeach, new_params, grads, **kw)
    for a, b in zip(ref_params, new_params, strict=True):
        assert b.dtype == torch.float16
        # fp32 arithmetic as fairseq's, then one rounding to fp16: equal, or one fp16 ulp apart
        assert torch.allclose(b.float(), a.float(), rtol=2**-10, atol=0)
        assert new.state[b]["exp_avg"].dtype == torch.float32 == ref.state[a]["exp_avg"].dtype


def test_state_dict_loads_into_fairseqs_adam_and_training_continues_identically():
    grads = _grads()
    kw = dict(lr=3e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    params = _params(torch.float64)
    opt = _run(AdamForeach, params, grads[:6], **kw)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = FairseqAdamImpl(twin, **kw)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    for step_grads in grads[6:]:
        for a, b, gr in zip(params, twin, step_grads, strict=True):
            a.grad, b.grad = gr.clone(), gr.clone()
        opt.step()
        other.step()
    for a, b in zip(params, twin, strict=True):
        assert torch.allclose(a, b, rtol=1e-13 * STEPS, atol=0)


def test_parameters_added_later_keep_their_own_step_count():
    """A parameter whose state starts later gets its own bias correction, as in fairseq's per-tensor loop."""
    grads = _grads()
    kw = dict(lr=3e-3, betas=(0.9, 0.98), eps=1e-8)
    ref_params, new_params = _params(torch.float64), _params(torch.float64)
    opts = [cls(ps, **kw) for cls, ps in ((FairseqAdamImpl, ref_params), (AdamForeach, new_params))]
    for t, step_grads in enumerate(grads):
        for ps, opt in zip((ref_params, new_params), opts, strict=True):
            for i, (p, gr) in enumerate(zip(ps, step_grads, strict=True)):
                p.grad = gr.clone() if (i != 0 or t >= 4) else None  # the first tensor joins at step 5
            opt.step()
    assert opts[1].state[new_params[0]]["step"] == STEPS - 4 and opts[1].state[new_params[1]]["step"] == STEPS
    for a, b in zip(ref_params, new_params, strict=True):
        assert torch.allclose(b, a, rtol=1e-13 * STEPS, atol=0)


def _aten_calls(opt_cls, n_tensors: int) -> dict:
    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(n_tensors)]
    opt = opt_cls(params, lr=1e-3, weight_decay=0.01)
    for p in params:
        p.grad = torch.randn(16)
    opt.step()  # state initialised outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}


def test_operator_calls_do_not_grow_with_the_number_of_tensors():
    """The point of the optimizer: fairseq's Adam issues ~10 operators per tensor, this one a fixed set."""
    few, many = _aten_calls(AdamForeach, 4), _aten_calls(AdamForeach, 64)
    foreach = {k: v for k, v in many.items() if k.startswith("aten::_foreach_")}
    assert foreach and all(few.get(k) == v for k, v in foreach.items()), (few, many)
    ref_few, ref_many = _aten_calls(FairseqAdamImpl, 4), _aten_calls(FairseqAdamImpl, 64)
    assert ref_many["aten::addcdiv_"] == 64 and ref_few["aten::addcdiv_"] == 4
    assert sum(foreach.values()) < 12  # mul, add, mul, addcmul, sqrt, add, add (decay), addcdiv


def test_selectable_from_the_command_line_with_adams_options():
    from fairseq import optim, options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from conftest import USER_DIR

    argv = ["/nonexistent", "--user-dir", USER_DIR, "--arch", "postln_iwslt_de_en", "--optimizer", "adam_foreach",
            "--adam-betas", "(0.9,0.98)", "--adam-eps", "1e-9", "--weight-decay", "0.0001", "--lr", "7e-4"]  # fmt: skip
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    cfg = convert_namespace_to_omegaconf(args)
    opt = optim.build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(3))])
    assert type(opt.optimizer) is AdamForeach
    group = opt.optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9 and group["weight_decay"] == 1e-4
    assert group["lr"] == pytest.approx(7e-4)
    # --fp16 flattens the fp32 master copy for it, as for fairseq's adam
    assert opt.supports_flat_params and opt.supports_memory_efficient_fp16
    cfg.optimizer.fp16_adam_stats = True
    with pytest.raises(DeepInitConfigError, match="--fp16-adam-stats needs apex"):
        optim.build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(3))])


@pytest.mark.parametrize("max_norm", [0.0, 1e-3, 1e3])
def test_gradient_norm_and_clipping_match_fairsequtils(max_norm):
    """gnorm and the clipped gradients against ``fairseq.utils.clip_grad_norm_`` (per-tensor loop)."""
    from fairseq import optim, utils
    from fairseq.optim.adam import FairseqAdamConfig

    params, twin = _params(torch.float32), _params(torch.float32)
    for p, q, gr in zip(params, twin, _grads()[0], strict=True):
        p.grad, q.grad = gr.float().clone(), gr.float().clone()
    cfg = FairseqAdamConfig(lr=[1e-3], adam_betas="(0.9, 0.98)")
    opt = optim.OPTIMIZER_REGISTRY["adam_foreach"](cfg, params)
    got = opt.clip_grad_norm(max_norm)
    want = utils.clip_grad_norm_(twin, max_norm)
    assert got.dtype == want.dtype == torch.float32
    assert torch.allclose(got, want, rtol=4e-7 * len(SHAPES), atol=0)
    for p, q in zip(params, twin, strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=4e-7 * len(SHAPES), atol=0)
    if max_norm == 1e-3:  # clipping happened: the clipped total is max_norm
        total = torch.norm(torch.stack([p.grad.norm() for p in params]))
        assert total == pytest.approx(1e-3, rel=1e-4)


def _train_inner(log: str) -> list[tuple[float, float]]:
    """(loss, gnorm) of every ``train_inner`` line of a ``--log-format json`` fairseq-train log."""
    rows = [json.loads(line.split("| train_inner | ", 1)[1]) for line in log.splitlines() if "| train_inner | " in line]
    return [(float(r["loss"]), float(r["gnorm"])) for r in rows]


def test_fairseq_train_follows_adams_trajectory_under_bf16_autocast(synthetic_bin, tmp_path):
    """fairseq-train end to end (bf16 autocast, clipping, weight decay): the same losses and gnorms as ``adam``
    (each run forked from a server that has imported fairseq: tests/cli_fork.py)."""
    from cli_fork import run_forked

    from conftest import TINY_DIMS, USER_DIR

    runs = {}
    for name in ("adam", "adam_foreach"):
        proc = run_forked(
            "train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation_deepinit", "--autocast-bf16",
            "--arch", "preln_iwslt_de_en", *TINY_DIMS, "--optimizer", name, "--adam-betas", "(0.9, 0.98)",
            "--weight-decay", "0.01", "--clip-norm", "0.5", "--lr", "1e-3", "--lr-scheduler", "inverse_sqrt",
            "--warmup-updates", "4", "--dropout", "0", "--max-tokens", "512", "--max-update", "8", "--seed", "3",
            "--log-format", "json", "--log-interval", "1", "--no-save", "--cpu", "--num-workers", "0",
            "--save-dir", tmp_path / name, log=tmp_path / f"{name}.log",
        )  # fmt: skip
        runs[name] = _train_inner(proc.stdout)
    ref, new = runs["adam"], runs["adam_foreach"]
    assert len(ref) == len(new) == 8
    assert ref[-1][0] < ref[0][0]  # it trains
    # fairseq logs 3 decimals; the two differ by the rounding of one total gradient norm per step, far
    # below that, but a value on a rounding boundary may still print one unit apart
    for (loss_a, gnorm_a), (loss_b, gnorm_b) in zip(ref, new, strict=True):
        assert abs(loss_a - loss_b) <= 1.01e-3 and abs(gnorm_a - gnorm_b) <= 1.01e-3, (ref, new)


def test_an_adam_run_resumes_with_adam_foreach_as_adam_would_continue(synthetic_bin, tmp_path):
    """fairseq's trainer checks the optimizer's class name on resume (``trainer.py`` 604-615); ``adam`` and
    ``adam_foreach`` share the state layout, so an ``adam`` checkpoint resumes under ``adam_foreach``.

    Reference: the same ``adam`` run never interrupted. Dropout is off and gradients are not clipped,
    so the resumed run applies the same element-wise operations to the same state in the same order
    (the CPU ``_foreach`` kernels are the per-tensor ones): equal to the bit here. The tolerance,
    1e-3 x lr per weight, leaves room for a few reordered roundings (|w| < 1, ~1e-8 each) and is
    far below what a lost optimizer state changes: resuming with ``--reset-optimizer`` moves the weights
    by ~1e-2 (about 10 x lr; measured 9.8e-3 on the development machine) in these 4 updates.
    """
    from concurrent.futures import ThreadPoolExecutor

    from cli_fork import run_forked

    from conftest import TINY_DIMS, USER_DIR

    lr = 1e-3

    def train(save_dir, optimizer: str, max_update: int):
        return run_forked(
            "train", synthetic_bin, "--user-dir", USER_DIR, "--arch", "postln_iwslt_de_en", *TINY_DIMS,
            "--optimizer", optimizer, "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.01", "--lr", str(lr),
            "--dropout", "0", "--max-tokens", "512", "--max-update", str(max_update), "--seed", "3",
            "--no-epoch-checkpoints", "--log-format", "simple", "--cpu", "--num-workers", "0", "--save-dir", save_dir,
            log=f"{save_dir}.{optimizer}.{max_update}.log",
        )  # fmt: skip

    with ThreadPoolExecutor(max_workers=2) as pool:
        whole = pool.submit(train, tmp_path / "whole", "adam", 8)
        first = pool.submit(train, tmp_path / "resumed", "adam", 4)
        whole.result(), first.result()
    resumed = train(tmp_path / "resumed", "adam_foreach", 8).stdout
    assert "Loaded checkpoint" in resumed and "(epoch 1 @ 4 updates)" in resumed
    assert "resuming the optimizer state of FairseqAdam with FairseqAdamForeach" in resumed

    def load(folder):
        return torch.load(tmp_path / folder / "checkpoint_last.pt", map_location="cpu", weights_only=True)

    ref, got = load("whole"), load("resumed")
    assert [h["num_updates"] for h in got["optimizer_history"]] == [4, 8]
    assert got["optimizer_history"][0]["resumed_from_optimizer"] == "FairseqAdam"
    assert got["optimizer_history"][-1]["optimizer_name"] == "FairseqAdamForeach"
    for key, value in ref["model"].items():
        if value.is_floating_point():
            assert torch.allclose(got["model"][key], value, rtol=0, atol=1e-3 * lr), key
    # the optimizer state carried on: moments and step counts as the uninterrupted run's
    ref_state, got_state = ref["last_optimizer_state"]["state"], got["last_optimizer_state"]["state"]
    assert ref_state.keys() == got_state.keys() and ref_state
    for i, state in ref_state.items():
        assert got_state[i]["step"] == state["step"] == 8
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(got_state[i][k], state[k], rtol=1e-4, atol=0), (i, k)
