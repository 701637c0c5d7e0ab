"""Depth-muP / CompleteP constants and parameter groups (``fairseq_deepinit/training/depth_mup.py``) and the
per-group optimizer multipliers (``fairseq_deepinit/training/param_groups.py``).

References: the independent port ``tests/ports/depth_mup.py`` (constants of the three sources), fairseq's
parameter names (the groups, re-derived here from the names alone), fairseq's ``Adam.step`` written out by
hand (two steps), fairseq's own ``inverse_sqrt`` scheduler, ``FP16Optimizer`` and
``MemoryEfficientFP16Optimizer`` (built on CPU as ``Trainer._build_optimizer`` builds them), and fairseq's
``Trainer`` itself (build, save, resume).

Tolerances. The constants are Python floats from the same formulas in another order: a few roundings,
``rel 1e-14``. The hand-computed Adam steps run in float64: about ten element-wise operations per step,
each rounded once (2^-53 relative to what it adds or subtracts) in either implementation, and a
vectorised kernel may fuse a multiply and an add (one rounding fewer). Consecutive steps of opposite
sign cancel, so the error is measured against the sum of the magnitudes each step moves (``hand_adam``),
not against the result: :data:`ULPS` = 32 such units for two steps (3.4 measured with the AVX2/AVX-512
kernels, 0 with ``ATEN_CPU_CAPABILITY=default``, on this VM). A wrong multiplier changes the update by
30 % or more (gradients down to 1e-9 make eps matter), thirteen orders of magnitude above that.
"""

from __future__ import annotations

import copy
import functools
import io
import logging
import math

import pytest
import torch
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.optim import FP16Optimizer, MemoryEfficientFP16Optimizer
from fairseq.optim.adam import FairseqAdam
from fairseq.optim.lr_scheduler import build_lr_scheduler
from ports import depth_mup as port

from conftest import build_model, make_dictionary
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.training import depth_mup as dm
from fairseq_deepinit.training import depth_mup_trainer as dmt
from fairseq_deepinit.training import param_groups as pg
from fairseq_deepinit.training.adam_foreach import FairseqAdamForeach

PRE = ("--encoder-normalize-before", "--decoder-normalize-before")
LR, EPS, WD, WARMUP = 2e-3, 1e-8, 0.01, 4
OPTIMIZERS = [pg.FairseqAdamScaled, FairseqAdamForeach]
ULPS = 32  # rounding budget of two Adam steps in float64 (module docstring)


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg, msg
    return msg


def translation(*cli: str):
    return build_model("deepinit_tiny", *PRE, *cli)[0]


def language_model(*cli: str):
    from fairseq.tasks.language_modeling import LanguageModelingTask

    import fairseq_deepinit  # noqa: F401

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, ["/nonexistent", "--task", "language_modeling", "--arch", "deepinit_lm_tiny", *cli]
    )
    d = make_dictionary(50)
    torch.manual_seed(1)
    return LanguageModelingTask(args, d, d).build_model(args)


@functools.cache  # parsing and hydra's compose cost about a second each; nothing mutates them
def train_args(*extra: str):
    """fairseq-train's parsed arguments for the optimizer and scheduler under test (Adam's flags unless
    ``extra`` names another ``--optimizer``)."""
    adam = (
        ()
        if "--optimizer" in extra
        else ("--optimizer", "adam_foreach", "--adam-eps", str(EPS), "--weight-decay", str(WD))
    )
    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser,
        ["/nonexistent", "--task", "translation", "--arch", "deepinit_tiny", "-s", "src", "-t", "tgt", *adam,
         "--lr", str(LR), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(WARMUP), "--warmup-init-lr",
         "1e-7", *extra],
    )  # fmt: skip


@functools.cache
def train_cfg(*extra: str):
    return convert_namespace_to_omegaconf(train_args(*extra))


def tagged(model, base=1, alpha=1.0, source="paper"):
    groups = dm.param_groups(model, base, alpha, source)
    dm.tag_parameters(model, groups)
    return groups


def trained(model):
    return [p for p in model.parameters() if p.requires_grad]


# --------------------------------------------------------------------------------------------- constants

DEPTHS = [(48, 6), (18, 6), (6, 6), (12, 6), (3, 6), (24, 4), (7, 3), (2, 1)]


@pytest.mark.parametrize("source", dm.SOURCES)
def test_constants_equal_the_port(source):
    alphas = [1.0] if source == "megatron" else [0.5, 0.75, 1.0]
    checked = 0
    for (n, base), alpha, width in [(d, a, w) for d in DEPTHS for a in alphas for w in (1.0, 4.0, 0.5)]:
        assert math.isclose(dm.branch_multiplier(n, base, alpha), port.branch_multiplier(n, base, alpha), rel_tol=1e-14)
        got = dm.group_scales(n, base, alpha, source, width_mult=width)
        want = port.group_scales(n, base, alpha, source, width_mult=width)
        assert set(got) == set(want) == set(dm.KINDS)
        for kind in dm.KINDS:
            for key in ("lr", "eps", "weight_decay"):
                assert math.isclose(getattr(got[kind], key), want[kind][key], rel_tol=1e-14), (
                    n,
                    base,
                    alpha,
                    kind,
                    key,
                )
                checked += 1
    assert checked >= 3 * 8 * 6 * 3


def test_constants_hand_values():
    # the 6 -> 48 layers: CompleteP 1/8, Depth-muP 8^-1/2 (new_methods.md section 7)
    assert dm.branch_multiplier(48, 6, 1.0) == 0.125
    assert dm.branch_multiplier(48, 6, 0.5) == pytest.approx(8**-0.5, rel=1e-15)
    completep = dm.group_scales(48, 6, 1.0, "paper")
    assert completep["hidden_weight"] == pg.GroupScale(1.0, 0.125, 1.0)
    assert completep["hidden_norm"] == completep["hidden_bias"] == pg.GroupScale(1.0, 0.125, 1.0)
    assert completep["embedding"] == completep["final_norm"] == completep["output"] == pg.GroupScale()
    depth_mup = dm.group_scales(48, 6, 0.5, "paper")
    for kind in dm.BLOCK_KINDS:
        assert depth_mup[kind].lr == pytest.approx(8**-0.5) and depth_mup[kind].eps == pytest.approx(8**-0.5)
    nano = dm.group_scales(48, 6, 1.0, "nanogpt")
    assert all(nano[k].eps == 0.125 for k in dm.KINDS)  # one eps for all groups (model.py:335)
    assert [nano[k].weight_decay for k in dm.KINDS] == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    meg = dm.group_scales(48, 6, 1.0, "megatron")
    assert meg["hidden_weight"] == pg.GroupScale(1.0, 0.125, 1.0)
    assert all(meg[k] == pg.GroupScale() for k in dm.KINDS if k != "hidden_weight")
    # Megatron's own tests: m_N = 4, m_L = 16/4 -> hidden lr 1/4, eps 1/16; 24 over 12 layers -> 0.5, eps 0.5
    wide = dm.group_scales(16, 4, 1.0, "megatron", width_mult=4.0)["hidden_weight"]
    assert (wide.lr, wide.eps) == (0.25, 1 / 16)
    assert dm.branch_multiplier(24, 12, 1.0) == 0.5
    assert dm.group_scales(24, 12, 1.0, "megatron")["hidden_weight"].eps == 0.5
    # at the base depth nothing changes
    for source, alpha in [("paper", 0.5), ("paper", 1.0), ("nanogpt", 0.5), ("megatron", 1.0)]:
        scales = dm.group_scales(6, 6, alpha, source)
        assert all((s.lr, s.eps) == (1.0, 1.0) for s in scales.values())
    assert dm.ALPHAS == {"depth-mup": 0.5, "completep": 1.0} and dm.DEFAULT_ALPHA == 1.0


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: dm.check_alpha(0.4), "[0.5, 1]"),
        (lambda: dm.check_alpha(1.5), "[0.5, 1]"),
        (lambda: dm.group_scales(48, 6, 0.5, "megatron"), "fixes alpha = 1"),
        (lambda: dm.group_scales(48, 6, 1.0, "mup"), "choose one of paper, nanogpt, megatron"),
        (lambda: dm.branch_multiplier(48, 0), "--depth-mup-base-layers 0"),
        (lambda: dm.depth_multiplier(0, 6), "at least one layer"),
    ],
)
def test_bad_constants_are_refused_in_one_line(call, fragment):
    with pytest.raises(DeepInitConfigError) as exc:
        call()
    assert fragment in one_line(exc)


# ------------------------------------------------------------------------------------ parameter groups

LINEARS = ("k_proj", "v_proj", "q_proj", "out_proj", "fc1", "fc2")


def expected_group(name: str, shape: torch.Size) -> str:
    """The group from fairseq's parameter names alone (new_methods.md section 7, "Encoder-decoder")."""
    parts = name.split(".")
    if parts[1] == "layers":
        if len(shape) >= 2:
            kind = "hidden_weight"
        elif parts[-2] in LINEARS and parts[-1] == "bias":
            kind = "hidden_bias"
        else:
            assert "layer_norm" in parts[-2], name
            kind = "hidden_norm"
        return f"{parts[0]}.{kind}"
    return {
        "embed_tokens": "embedding",
        "embed_positions": "embedding",
        "output_projection": "output",
        "layer_norm": "final_norm",
        "layernorm_embedding": "final_norm",
    }[parts[1]]


@pytest.mark.parametrize(
    "build, cli, stacks",
    [
        (translation, (), ("encoder", "decoder")),
        (translation, ("--share-all-embeddings",), ("encoder", "decoder")),
        (translation, ("--layernorm-embedding", "--encoder-learned-pos", "--decoder-learned-pos"), ("encoder",
                                                                                                  "decoder")),
        (language_model, (), ("decoder",)),
        (language_model, ("--share-decoder-input-output-embed",), ("decoder",)),
    ],
)  # fmt: skip
def test_every_parameter_is_in_exactly_one_group(build, cli, stacks):
    model = build(*cli)
    groups = dm.param_groups(model, 1)
    named = dict(model.named_parameters())
    listed = [n for g in groups for n in g.param_names]
    assert sorted(listed) == sorted(named) and len(listed) == len(set(listed))
    got = {n: g.name for g in groups for n in g.param_names}
    assert got == {n: expected_group(n, p.shape) for n, p in named.items()}
    assert {g.name.partition(".")[0] for g in groups if "hidden" in g.name} == set(stacks)
    tied = "--share-all-embeddings" in cli or "--share-decoder-input-output-embed" in cli
    assert any(g.name == "output" for g in groups) != tied  # a tied projection is the embedding's parameter
    if "--layernorm-embedding" in cli:
        assert "encoder.layernorm_embedding.weight" in got and got["encoder.embed_positions.weight"] == "embedding"


def test_each_stack_takes_its_own_depth_ratio():
    model = translation("--encoder-layers", "3", "--decoder-layers", "2")
    groups = {g.name: g.scale for g in dm.param_groups(model, {"encoder": 1, "decoder": 4}, 0.5, "paper")}
    enc, dec = port.group_scales(3, 1, 0.5, "paper"), port.group_scales(2, 4, 0.5, "paper")
    for kind in dm.BLOCK_KINDS:
        assert groups[f"encoder.{kind}"] == pg.GroupScale(**enc[kind])
        assert groups[f"decoder.{kind}"] == pg.GroupScale(**dec[kind])
    assert groups["embedding"] == groups["final_norm"] == pg.GroupScale()
    assert dm.stack_depths(model) == {"encoder": 3, "decoder": 2}


def test_group_rule_refusals_are_one_line():
    model = translation("--encoder-layers", "3")
    with pytest.raises(DeepInitConfigError) as exc:
        dm.param_groups(model, 1, 1.0, "nanogpt")  # 3/1 and 2/1: one eps cannot follow both
    assert "encoder 3/1, decoder 2/1" in one_line(exc)
    dm.param_groups(model, {"encoder": 3, "decoder": 2}, 1.0, "nanogpt")  # equal ratios: fine
    with pytest.raises(DeepInitConfigError) as exc:
        dm.param_groups(model, {"encoder": 3}, 1.0)
    assert "no base depth for the decoder" in one_line(exc)
    model.encoder.extra = torch.nn.Linear(4, 4)
    with pytest.raises(DeepInitConfigError) as exc:
        dm.param_groups(model, 1)
    assert "encoder.extra.weight, encoder.extra.bias" in one_line(exc)
    with pytest.raises(DeepInitConfigError) as exc:
        dm.stacks(torch.nn.Linear(2, 2))
    one_line(exc)


# ----------------------------------------------------------------------------------------- optimizer


def base_lr_formula(step: int, init: float = 1e-7) -> float:
    """fairseq's inverse_sqrt schedule (inverse_square_root_schedule.py docstring)."""
    if step < WARMUP:
        return init + step * (LR - init) / WARMUP
    return LR * math.sqrt(WARMUP) / math.sqrt(step)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("source, alpha", [("paper", 0.5), ("nanogpt", 0.5), ("megatron", 1.0)])
def test_groups_lr_eps_and_weight_decay_follow_set_lr_and_the_scheduler(cls, source, alpha):
    model = translation()
    groups = tagged(model, 1, alpha, source)
    cfg = train_cfg()
    opt = cls(cfg.optimizer, trained(model))
    names = {id(p): n for n, p in model.named_parameters()}
    assert [g["group"] for g in opt.param_groups] == [g.name for g in groups]
    for want, got in zip(groups, opt.param_groups, strict=True):
        assert [names[id(p)] for p in got["params"]] == list(want.param_names)
        assert got["lr"] == LR * want.scale.lr and got["eps"] == EPS * want.scale.eps
        assert got["weight_decay"] == WD * want.scale.weight_decay
        assert (got["lr_scale"], got["eps_scale"], got["weight_decay_scale"]) == (
            want.scale.lr,
            want.scale.eps,
            want.scale.weight_decay,
        )
    assert {g.scale.lr for g in groups} != {1.0} or source == "megatron"  # the test has lr multipliers to check
    opt.set_lr(0.5)
    assert opt.get_lr() == 0.5
    assert [g["lr"] for g in opt.param_groups] == [0.5 * g.scale.lr for g in groups]
    sched = build_lr_scheduler(cfg.lr_scheduler, opt)
    for step in (0, 1, 3, 4, 9, 100):
        sched.step_update(step)
        assert opt.get_lr() == pytest.approx(base_lr_formula(step), rel=1e-12)
        assert [g["lr"] for g in opt.param_groups] == [opt.get_lr() * g.scale.lr for g in groups]
        assert [g["eps"] for g in opt.param_groups] == [EPS * g.scale.eps for g in groups]


def test_without_tags_the_optimizer_is_fairseqs():
    model = translation()
    cfg = train_cfg()
    ours, stock = pg.FairseqAdamScaled(cfg.optimizer, trained(model)), FairseqAdam(cfg.optimizer, trained(model))
    assert len(ours.param_groups) == 1
    assert ours.param_groups[0].keys() == stock.param_groups[0].keys()
    ours.set_lr(0.25), stock.set_lr(0.25)
    assert ours.get_lr() == stock.get_lr() == 0.25
    assert ours.state_dict()["param_groups"][0].keys() == stock.state_dict()["param_groups"][0].keys()


def test_get_lr_is_the_base_rate_when_no_group_keeps_it():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    pg.tag_parameter(params[0], "a", pg.GroupScale(lr=0.5, eps=0.25))
    pg.tag_parameter(params[1], "b", pg.GroupScale(lr=3.0, weight_decay=0.0))
    opt = FairseqAdamForeach(train_cfg().optimizer, params)
    assert [(g["lr"], g["eps"], g["weight_decay"]) for g in opt.param_groups] == [
        (LR * 0.5, EPS * 0.25, WD),
        (LR * 3.0, EPS, 0.0),
    ]
    opt.set_lr(0.1)
    assert opt.get_lr() == 0.1 and [g["lr"] for g in opt.param_groups] == [0.05, 0.1 * 3.0]
    assert pg.parameter_tag(params[1]) == ("b", pg.GroupScale(lr=3.0, weight_decay=0.0))
    pg.tag_parameter(params[1], "a", pg.GroupScale(lr=3.0))
    with pytest.raises(DeepInitConfigError) as exc:  # one name, two sets of multipliers
        pg.FairseqAdamScaled(train_cfg().optimizer, params)
    assert "different multipliers" in one_line(exc)


def hand_adam(params, grads_per_step, lr, eps, wd, betas=(0.9, 0.999)):
    """fairseq 0.12.3 ``fairseq/optim/adam.py`` ``Adam.step``, written out for one tensor.

    Returns the parameters and, per element, the sum over steps of the magnitudes the update adds and
    subtracts (``|p| + |wd lr p| + |step|``), the scale of its rounding errors: consecutive steps of
    opposite sign cancel, so the error is not relative to the result.
    """
    p = params.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    magnitude = torch.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads_per_step, start=1):
        m = m * b1 + (1 - b1) * g
        v = v * b2 + (1 - b2) * g * g
        step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        decay, update = wd * lr * p, step_size * m / (v.sqrt() + eps)
        magnitude += p.abs() + decay.abs() + update.abs()
        p = p - decay - update
    return p, magnitude


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("source, alpha", [("paper", 0.5), ("paper", 1.0), ("nanogpt", 0.5), ("megatron", 1.0)])
def test_adam_steps_equal_hand_computed_steps_with_each_groups_lr_and_eps(cls, source, alpha):
    model = translation().double()
    tagged(model, 1, alpha, source)
    opt = cls(train_cfg().optimizer, trained(model))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    grads = []
    for _ in range(2):
        # gradient scales 1 .. 1e-9: where they are small, eps decides the step
        step = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) * 10.0 ** -(3 * (k % 4))
                for k, (n, p) in enumerate(model.named_parameters())}  # fmt: skip
        grads.append(step)
        for n, p in model.named_parameters():
            p.grad = step[n].clone()
        opt.step()
    scales = port.group_scales(2, 1, alpha, source)  # both stacks have 2 layers
    for n, p in model.named_parameters():
        kind = expected_group(n, p.shape).rpartition(".")[2]
        s = scales[kind]
        want, magnitude = hand_adam(
            start[n], [g[n] for g in grads], LR * s["lr"], EPS * s["eps"], WD * s["weight_decay"]
        )
        err = (p.detach() - want).abs()
        assert (err <= ULPS * 2.0**-53 * magnitude).all(), (n, (err / magnitude).max().item())
        assert not torch.equal(p.detach(), start[n])


def state_roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def step_with(model, opt, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-4
    opt.step()


def group_settings(opt) -> list:
    keys = ("group", "lr", "eps", "weight_decay", "betas", "lr_scale", "eps_scale", "weight_decay_scale")
    return [tuple(tuple(g[k]) if k == "betas" else g[k] for k in keys) for g in opt.param_groups]


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_save_and_resume_keep_groups_rates_and_state(cls):
    model = translation()
    tagged(model, 1, 0.5, "paper")
    cfg = train_cfg()
    opt = cls(cfg.optimizer, trained(model))
    sched = build_lr_scheduler(cfg.lr_scheduler, opt)
    for update in range(1, 3):
        step_with(model, opt, update)
        sched.step_update(update)
    saved = state_roundtrip({"optimizer": opt.state_dict(), "lr_scheduler": sched.state_dict()})

    resumed_model = copy.deepcopy(model)
    tagged(resumed_model, 1, 0.5, "paper")  # torch's Parameter.__deepcopy__ keeps data and requires_grad only
    resumed = cls(cfg.optimizer, trained(resumed_model))
    resumed_sched = build_lr_scheduler(cfg.lr_scheduler, resumed)
    resumed_sched.step_update(0)  # as Trainer._build_optimizer does, before the checkpoint is read
    resumed.load_state_dict(saved["optimizer"])
    resumed_sched.load_state_dict(saved["lr_scheduler"])
    resumed_sched.step_update(2)  # Trainer.load_checkpoint -> set_num_updates -> lr_step_update
    assert group_settings(resumed) == group_settings(opt)
    for a, b in zip(trained(model), trained(resumed_model), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.optimizer.state[a][key], resumed.optimizer.state[b][key])
    for update in (3, 4):
        step_with(model, opt, update), step_with(resumed_model, resumed, update)
        sched.step_update(update), resumed_sched.step_update(update)
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_resume_refuses_other_groups_and_rescales_changed_multipliers(caplog):
    cfg = train_cfg()
    model = translation()
    tagged(model, 1, 0.5, "paper")
    opt = pg.FairseqAdamScaled(cfg.optimizer, trained(model))
    step_with(model, opt, 1)
    state = state_roundtrip(opt.state_dict())

    stock = FairseqAdam(cfg.optimizer, trained(translation()))
    with pytest.raises(DeepInitConfigError) as exc:
        opt.load_state_dict(stock.state_dict())
    assert "(one group, no multipliers)" in one_line(exc) and "--reset-optimizer" in str(exc.value)
    lm = language_model()
    tagged(lm, 1)
    with pytest.raises(DeepInitConfigError) as exc:
        pg.FairseqAdamScaled(cfg.optimizer, trained(lm)).load_state_dict(state)
    assert "encoder.hidden_weight" in one_line(exc)

    # this run says alpha = 1 (the checkpoint's config check let the change through): its multipliers win
    other = translation()
    groups = tagged(other, 1, 1.0, "paper")
    changed = pg.FairseqAdamScaled(cfg.optimizer, trained(other))
    with caplog.at_level(logging.WARNING):
        changed.load_state_dict(state)
    assert "resuming with this run's optimizer group multipliers" in caplog.text
    for g, want, old in zip(changed.param_groups, groups, opt.param_groups, strict=True):
        assert (g["lr_scale"], g["eps_scale"]) == (want.scale.lr, want.scale.eps)
        assert g["eps"] == pytest.approx(EPS * want.scale.eps, rel=1e-15)
        assert g["lr"] == pytest.approx(old["lr"] / old["lr_scale"] * want.scale.lr, rel=1e-15)

    # --optimizer-overrides are base values, scaled per group
    fresh = pg.FairseqAdamScaled(cfg.optimizer, trained(model))
    fresh.load_state_dict(state, {"lr": 0.1, "eps": 1e-6, "betas": (0.8, 0.9)})
    for g in fresh.param_groups:
        assert (g["lr"], g["eps"], g["betas"]) == (0.1 * g["lr_scale"], 1e-6 * g["eps_scale"], (0.8, 0.9))


@pytest.mark.parametrize("wrapper", ["fp16_no_flatten", "memory_efficient"])
def test_fairseqs_fp16_wrappers_carry_the_groups(wrapper):
    extra = (
        ("--fp16", "--fp16-no-flatten-grads") if wrapper == "fp16_no_flatten" else ("--fp16", "--memory-efficient-fp16")
    )
    args = train_args(*extra)
    dmt.check_training_config(args)
    cfg = convert_namespace_to_omegaconf(args)
    model = translation()
    groups = tagged(model, 1, 0.5, "paper")

    def build(params):
        # what FP16Optimizer.build_optimizer / MemoryEfficientFP16Optimizer.build_optimizer do, with our class
        if wrapper == "fp16_no_flatten":
            fp32 = FP16Optimizer.build_fp32_params(cfg.optimizer, params, flatten=False)
            return FP16Optimizer(cfg, params, FairseqAdamForeach(cfg.optimizer, fp32), fp32)
        return MemoryEfficientFP16Optimizer(cfg, params, pg.FairseqAdamScaled(cfg.optimizer, params))

    opt = build(trained(model))
    pg.check_groups_reached(opt, model)
    inner = pg.innermost(opt)
    assert [g["group"] for g in inner.param_groups] == [g.name for g in groups]
    sched = build_lr_scheduler(cfg.lr_scheduler, opt)
    sched.step_update(6)
    assert opt.get_lr() == pytest.approx(base_lr_formula(6), rel=1e-12)
    assert [g["lr"] for g in inner.param_groups] == [opt.get_lr() * g.scale.lr for g in groups]
    state = state_roundtrip(opt.state_dict())
    assert "loss_scale" in state
    resumed_model = copy.deepcopy(model)
    tagged(resumed_model, 1, 0.5, "paper")
    resumed = build(trained(resumed_model))
    resumed.load_state_dict(state)
    assert group_settings(pg.innermost(resumed)) == group_settings(inner)


def test_a_path_that_loses_the_groups_stops_in_one_line():
    cfg = train_cfg()
    model = translation()
    tagged(model, 1, 0.5)
    # --fp16 without --fp16-no-flatten-grads: one flat fp32 tensor (fp16_optimizer.py:33-61) without the tag
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in trained(model)]))
    flat_opt = FP16Optimizer(cfg, trained(model), pg.FairseqAdamScaled(cfg.optimizer, [flat]), flat)
    with pytest.raises(DeepInitConfigError) as exc:
        pg.check_groups_reached(flat_opt, model)
    assert "--fp16-no-flatten-grads" in one_line(exc)
    with pytest.raises(DeepInitConfigError) as exc:  # fairseq's own adam: the tags are not read
        pg.check_groups_reached(FairseqAdam(cfg.optimizer, trained(model)), model)
    assert "FairseqAdam " in one_line(exc)
    pg.check_groups_reached(FairseqAdam(cfg.optimizer, trained(translation())), translation())  # no tags: nothing
    with pytest.raises(DeepInitConfigError) as exc:  # a parameter outside the rule (a criterion's, say)
        pg.FairseqAdamScaled(cfg.optimizer, [*trained(model), torch.nn.Parameter(torch.zeros(3))])
    assert "1 of the" in one_line(exc)


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (("--optimizer", "sgd"), "--optimizer sgd"),
        (("--optimizer", "composite"), "--optimizer composite"),
        (("--optimizer", "radam"), "--optimizer radam"),
        (("--optimizer", "adam"), "use --optimizer adam_foreach"),
        (("--fp16",), "--fp16-no-flatten-grads"),
        (("--zero-sharding", "os"), "--zero-sharding os"),
    ],
)
def test_training_options_that_cannot_work_are_refused_in_one_line(extra, fragment):
    with pytest.raises(DeepInitConfigError) as exc:
        dmt.check_training_config(train_args(*extra))
    assert fragment in one_line(exc)


@pytest.mark.parametrize(
    "extra",
    [(), ("--fp16", "--fp16-no-flatten-grads"), ("--fp16", "--memory-efficient-fp16"),
     ("--amp",)],
)  # fmt: skip
def test_training_options_that_work_pass_the_check(extra):
    dmt.check_training_config(train_args(*extra))


@pytest.mark.parametrize("precision", [(), ("--fp16", "--fp16-no-flatten-grads")])
def test_fairseqs_trainer_builds_saves_and_resumes_the_groups(tmp_path, precision):
    """fairseq's own ``Trainer``: optimizer and scheduler built by ``_build_optimizer`` (under ``--fp16``
    after ``model.half()``, through ``FP16Optimizer``'s fp32 copies), saved by ``save_checkpoint`` and
    resumed by ``load_checkpoint`` (rates restored by ``set_num_updates``), with ``--optimizer adam_foreach``
    (registered with the mixin); the parameters tagged by hand."""
    from fairseq.tasks.translation import TranslationTask
    from fairseq.trainer import Trainer

    def trainer():
        cfg = convert_namespace_to_omegaconf(
            train_args(*PRE, "--optimizer", "adam_foreach", "--cpu", "--save-dir", str(tmp_path), *precision)
        )
        d = make_dictionary(50)
        task = TranslationTask(cfg.task, d, d)
        torch.manual_seed(1)
        model = task.build_model(cfg.model)
        groups = tagged(model, 1, 0.5)
        return Trainer(cfg, task, model, task.build_criterion(cfg.criterion)), model, groups

    first, model, groups = trainer()
    pg.check_groups_reached(first.optimizer, model)
    for update in range(1, 4):
        first.set_num_updates(update)
    assert first.get_lr() == pytest.approx(base_lr_formula(3), rel=1e-12)
    inner = pg.innermost(first.optimizer)
    assert [g["lr"] for g in inner.param_groups] == [first.get_lr() * g.scale.lr for g in groups]
    first.consolidate_optimizer()
    first.save_checkpoint(str(tmp_path / "checkpoint.pt"), {})
    resumed, _, _ = trainer()
    resumed.load_checkpoint(str(tmp_path / "checkpoint.pt"))
    assert resumed.get_num_updates() == 3
    assert group_settings(pg.innermost(resumed.optimizer)) == group_settings(inner)
