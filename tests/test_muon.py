"""``--optimizer muon`` (fairseq_deepinit/training/muon.py) against the independent port of Moonlight's released
Muon (``tests/ports/muon.py``, MoonshotAI/Moonlight ``examples/toy_train.py``): the update in float64 (Nesterov and
plain momentum, tall / wide / square / 3-D matrices, the AdamW part, weight decay) and in bfloat16 as released,
deliberate mutations (a Newton-Schulz coefficient, the RMS-matching factor, the AdamW bias correction) failing;
the roles of a translation model's and a language model's parameters; fairseq updates (the scheduler's lr in both
groups, ``--update-freq 2``), ``--fp16-no-flatten-grads``' master weights and its state dict round trip, the
refusals, MuonClip (``--qk-clip`` after Muon's step, against the QK-Clip port), and fairseq-train end to end:
translation and LM, a resumed run equal to the uninterrupted one, two CPU ranks equal.

Tolerances: float64 against float64 (the same operations in another order: 1e-12 relative); bfloat16 against the
port's bfloat16 path (the same operations: a bfloat16 ulp of the update, ``2**-7`` of its largest entry); the
in-process updates in float32 against the port in float64 from the same float32 gradients (float32 rounding of
the Newton-Schulz iterates, amplified by ``a = 3.4`` per step: ``1e-4`` of the update).
"""

from __future__ import annotations

import copy

import pytest
import torch
from ports import muon as port

from conftest import TINY_DIMS, USER_DIR, run_cli, tiny_sample, tiny_trainer
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.training import muon
from fairseq_deepinit.training.param_groups import GroupScale, tag_parameter

# two square and two tall matrices: Muon orthogonalises matrices of one shape in one batched chain
SHAPES = {"wide": (6, 10), "tall": (12, 5), "square": (8, 8), "conv": (4, 3, 2), "bias": (7,), "embed": (9, 4),
          "square2": (8, 8), "tall2": (12, 5)}  # fmt: skip
MUON_NAMES = {"wide", "tall", "square", "conv", "square2", "tall2"}


def direct(ns_fp32: bool, nesterov: bool = True, wd: float = 0.1, lr: float = 0.02, dtype=torch.float64):
    """``(FairseqMuon, its parameters by name)`` over :data:`SHAPES` tagged as the roles would."""
    torch.manual_seed(0)
    params = {k: torch.nn.Parameter(torch.randn(s, dtype=dtype)) for k, s in SHAPES.items()}
    for name, p in params.items():
        tag_parameter(p, muon.MUON if name in MUON_NAMES else muon.ADAMW, GroupScale())
    cfg = muon.FairseqMuonConfig(muon_no_nesterov=not nesterov, muon_ns_fp32=ns_fp32, weight_decay=wd, lr=[lr],
                                 adam_betas="(0.9, 0.95)", adam_eps=1e-8)  # fmt: skip
    return muon.FairseqMuon(cfg, list(params.values())), params


def run_both(ns_fp32: bool, nesterov: bool = True, steps: int = 4, wd: float = 0.1, lr: float = 0.02):
    opt, params = direct(ns_fp32, nesterov, wd, lr)
    ref = port.MoonlightMuon({k: p.detach() for k, p in params.items()}, MUON_NAMES, lr, wd, nesterov=nesterov,
                             ns_dtype=torch.float64 if ns_fp32 else torch.bfloat16)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = {k: torch.randn(p.shape, generator=gen, dtype=p.dtype) for k, p in params.items()}
        for k, p in params.items():
            p.grad = grads[k].clone()
        opt.step()
        ref.step(grads)
    return {k: p.detach() for k, p in params.items()}, ref.params


@pytest.mark.parametrize("nesterov", [True, False])
def test_float64_update_is_the_released_one(nesterov):
    got, want = run_both(ns_fp32=True, nesterov=nesterov)
    for k in SHAPES:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12, msg=k)


def test_bfloat16_newton_schulz_is_the_released_one():
    got, want = run_both(ns_fp32=False, steps=2)
    for k in SHAPES:
        update = (want[k] - direct(True)[1][k].detach()).abs().max()
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=float(update) * 2**-7, msg=k)


@pytest.mark.parametrize(
    "what, value",
    [("NS_COEFFICIENTS", (3.4445, -4.7750, 2.0)), ("RMS_MATCH", 0.25), ("NS_EPS", 1e-2)],
)
def test_a_mutated_constant_fails(monkeypatch, what, value):
    monkeypatch.setattr(muon, what, value)
    got, want = run_both(ns_fp32=True)
    assert any(not torch.allclose(got[k], want[k], rtol=1e-6, atol=1e-6) for k in MUON_NAMES)


def test_a_mutated_adamw_bias_correction_fails(monkeypatch):
    def no_correction(ps, grads, states, group):
        for state in states:
            if "step" in state:
                state["step"] = 0  # t stays 1: the first step's correction on every step
        real(ps, grads, states, group)

    real = muon.Muon._adamw
    monkeypatch.setattr(muon.Muon, "_adamw", staticmethod(no_correction))
    got, want = run_both(ns_fp32=True)
    assert not torch.allclose(got["bias"], want["bias"], rtol=1e-6, atol=1e-6)


def test_a_stack_is_orthogonalised_matrix_by_matrix():
    """The batched chain (one per shape) is each matrix's own NS5: its own norm, its own products."""
    g = torch.randn(3, 12, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * torch.tensor(
        [1.0, 10.0, 0.1], dtype=torch.float64
    ).view(3, 1, 1)
    got = muon.zeropower_via_newtonschulz5(g, 5, bf16=False)
    for i in range(3):
        torch.testing.assert_close(got[i], port.newton_schulz5(g[i], 5, torch.float64), rtol=1e-12, atol=1e-12)


def test_muons_step_kernels_do_not_grow_with_depth():
    """One batched chain per matrix shape (``benchmarks/optimizer_kernels.py``): the step launches as many kernels
    at 6+6 layers as at 2+2, where a loop over the matrices grows with them."""
    from deepinit_tools.bench.optimizer_kernels import measure

    shallow = measure("mt", ["--optimizer", "muon"])
    deep = measure("mt", ["--optimizer", "muon", "--encoder-layers", "6", "--decoder-layers", "6"])
    assert deep["tensors"] > shallow["tensors"] and deep["step"] == shallow["step"]
    assert deep["host_reads"] == measure("mt", ["--optimizer", "adam_foreach"])["host_reads"]


def test_newton_schulz_output_is_near_orthogonal():
    """What NS5 is for: the singular values of the output within the released (0.5, 1.5) band (docstring, 55-57)."""
    g = torch.randn(16, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    s = torch.linalg.svdvals(muon.zeropower_via_newtonschulz5(g, 5, bf16=False))
    assert 0.5 < float(s.min()) and float(s.max()) < 1.5


# --- roles ------------------------------------------------------------------------------------------------


def build(kind: str, *cli: str):
    """A fairseq ``Trainer`` on the CPU for a tiny Pre-LN model (no dropout) with ``--optimizer muon``."""
    return tiny_trainer(kind, "--optimizer", "muon", *cli)


@pytest.mark.parametrize("kind, cli", [("mt", ()), ("mt", ("--share-all-embeddings",)), ("lm", ())])
def test_roles_are_moonlights_split(kind, cli):
    """Muon: the matrices of the layers; AdamW: embeddings, the output projection (tied or not), norms, biases.
    Moonlight's split by name (``ndim >= 2``, not ``embed_tokens`` / ``lm_head``: fairseq's ``output_projection``)."""
    model = build(kind, *cli).model
    roles = muon.roles(model)
    named = [(n.replace("output_projection", "lm_head"), p) for n, p in model.named_parameters()]
    want = {n.replace("lm_head", "output_projection") for n in port.moonlight_split(named)}
    assert {n for n, r in roles.items() if r == muon.MUON} == want
    assert set(roles) == {n for n, _ in model.named_parameters()}
    assert any("layers.0.self_attn.q_proj.weight" in n for n in want)


# --- fairseq updates ---------------------------------------------------------------------------------------


def weights(t) -> dict:
    from fairseq_deepinit.training.qk_clip import master_weights

    masters = master_weights(t._optimizer)
    return {n: masters.get(id(p), p).detach().clone() for n, p in t._model.named_parameters()}


def grads(t) -> dict:
    from fairseq_deepinit.training.param_groups import innermost

    inner = innermost(t._optimizer)
    by_id = {id(p): p for g in inner.param_groups for p in g["params"]}
    model = dict(t._model.named_parameters())
    if hasattr(t._optimizer, "fp32_params"):  # the masters' grads, in model order
        by_id = dict(zip((id(p) for p in model.values()), t._optimizer.fp32_params, strict=True))
    return {n: by_id[id(p)].grad.detach().clone() for n, p in model.items()}


@pytest.mark.parametrize("kind, cli, seeds", [
    ("mt", ("--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4", "--weight-decay", "0.1"), (0,)),
    ("lm", ("--update-freq", "2"), (0, 1)),
    ("mt", ("--fp16", "--fp16-no-flatten-grads"), (0,)),
])  # fmt: skip
def test_fairseq_updates_are_the_ports(kind, cli, seeds):
    """Two updates of fairseq's trainer; each against the port from the weights before it, given the gradients
    the optimizer saw and the lr fairseq's scheduler set (both groups hold it)."""
    from fairseq_deepinit.training.param_groups import innermost

    t = build(kind, "--muon-ns-fp32", *cli)
    roles = muon.roles(t._model)
    wd = 0.1 if "--weight-decay" in cli else 0.0
    for update in range(2):
        before, lr = weights(t), t.get_lr()
        t.train_step([tiny_sample(kind, s + 2 * update) for s in seeds])
        groups = innermost(t._optimizer).param_groups
        assert isinstance(innermost(t._optimizer), muon.FairseqMuon)
        # the scheduler's next rate, in both groups
        assert sorted(g["group"] for g in groups) == ["adamw", "muon"] and {g["lr"] for g in groups} == {t.get_lr()}
        if update == 0:
            ref = port.MoonlightMuon({k: v.double() for k, v in before.items()},
                                     {n for n, r in roles.items() if r == muon.MUON}, lr, wd,
                                     ns_dtype=torch.float64)  # fmt: skip
        ref.lr = lr
        ref.step({k: v.double() for k, v in grads(t).items()})
        got = weights(t)
        for k, v in ref.params.items():
            step = float((v - before[k].double()).abs().max())
            torch.testing.assert_close(got[k].double(), v, rtol=0, atol=1e-4 * step + 1e-7, msg=k)
            ref.params[k] = got[k].double()  # the next update from the trainer's weights


def test_fp16_master_state_round_trip(tmp_path):
    """``--fp16 --fp16-no-flatten-grads``: the state dict of fairseq's FP16Optimizer over Muon loads into a new
    trainer (the group names checked), and both take the same next update."""
    a = build("mt", "--fp16", "--fp16-no-flatten-grads")
    a.train_step([tiny_sample("mt", 0)])
    state = a.optimizer.state_dict()
    assert [g["group"] for g in state["param_groups"]] == [g["group"] for g in a.optimizer.param_groups]
    assert any("momentum_buffer" in s for s in state["state"].values())
    b = build("mt", "--fp16", "--fp16-no-flatten-grads")
    b.optimizer.load_state_dict(copy.deepcopy(state))  # a copy: torch's load keeps the tensors it is given
    with torch.no_grad():
        for (_, pa), (_, pb) in zip(a._model.named_parameters(), b._model.named_parameters(), strict=True):
            pb.copy_(pa)
        for pa, pb in zip(a.optimizer.fp32_params, b.optimizer.fp32_params, strict=True):
            pb.copy_(pa)
    for t in (a, b):
        t.train_step([tiny_sample("mt", 1)])
    for (n, pa), (_, pb) in zip(a._model.named_parameters(), b._model.named_parameters(), strict=True):
        assert torch.equal(pa, pb), n


@pytest.mark.parametrize("cli, wrapper", [
    (("--memory-efficient-fp16",), "MemoryEfficientFP16Optimizer"), (("--amp",), "AMPOptimizer"),
])  # fmt: skip
def test_half_weights_and_amp_train_with_float32_state(cli, wrapper):
    """``--memory-efficient-fp16`` (fp16 weights stepped through float32 copies) and ``--amp``: two updates move
    every weight, finite, and Muon's state is float32 in both groups."""
    t = build("mt", *cli)
    before = {n: p.detach().clone() for n, p in t._model.named_parameters()}
    for update in range(2):
        t.train_step([tiny_sample("mt", update)])
    assert type(t._optimizer).__name__ == wrapper
    for n, p in t._model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p, before[n]), n
    from fairseq_deepinit.training.param_groups import innermost

    state = innermost(t._optimizer).optimizer.state
    kinds = {k for s in state.values() for k in s}
    assert {"momentum_buffer", "moment1", "moment2"} <= kinds
    assert all(v.dtype == torch.float32 for s in state.values() for v in s.values() if torch.is_tensor(v))


@pytest.mark.parametrize("cli, says", [
    (("--fp16",), "add --fp16-no-flatten-grads"),
    (("--zero-sharding", "os"), "drop --zero-sharding"),
    (("--depth-mup", "--init-scheme", "xavier"), "--optimizer muon does not"),
    (("--muon-momentum", "1.0"), "--muon-momentum 1.0: must be >= 0 and < 1"),
    (("--muon-ns-steps", "0"), "--muon-ns-steps 0"),
])  # fmt: skip
def test_refusals_are_one_line(cli, says, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    try:
        t = build("mt", *cli)
        t.optimizer  # noqa: B018
    except DeepInitConfigError as e:
        assert says in str(e) and "\n" not in str(e), str(e)
    else:
        pytest.fail(f"{cli} not refused")


def test_muonclip_clips_after_muons_step():
    """``--optimizer muon --qk-clip``: the clipped heads' q/k are the QK-Clip port's clip of the Muon-updated
    weights, everything else bit for bit the Muon update without the clip (tests/test_qk_clip.py's check)."""
    from test_qk_clip import check_clip, one_update

    t, ref, clip, maxima, port_maxima = one_update("mt", "--optimizer", "muon", "--muon-ns-fp32")
    assert type(t.optimizer).__name__ == "FairseqMuon" == type(ref.optimizer).__name__
    torch.testing.assert_close(maxima.double(), port_maxima, rtol=1e-5, atol=1e-5)
    assert check_clip(t, ref, clip, maxima) > 0


def test_an_update_reads_nothing_more_on_the_host_than_adams():
    """The CPU standing in for the device (``deepinit_tools.harness.host_reads``): Muon's step reads nothing, and
    an update with it makes exactly the host reads of the same update with ``adam_foreach``."""
    from deepinit_tools.harness.host_reads import HostReads
    from fairseq_deepinit.training.param_groups import innermost

    events = []
    for optimizer in ("muon", "adam_foreach"):
        t = build("mt", "--optimizer", optimizer)
        t.train_step([tiny_sample("mt", 0)])  # warm-up (lazy state)
        with HostReads(cpu_is_device=True) as hr:
            t.train_step([tiny_sample("mt", 1)])
        events.append([e.op for e in hr.events])
        t.train_step([tiny_sample("mt", 2)])
        with HostReads(cpu_is_device=True) as step_reads:
            innermost(t._optimizer).optimizer.step()  # the last update's gradients again
        assert step_reads.events == [], optimizer
    assert events[0] == events[1]


# --- fairseq-train ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.kernel_independent
@pytest.mark.parametrize("family, data", [("preln_translation", "synthetic_bin"), ("preln_lm", "lm_bin")])
def test_resumed_muon_run_is_the_uninterrupted_run(family, data, request, tmp_path):
    """fairseq-train with --optimizer muon (translation with --update-freq 2, a language model) trains, saves,
    and a run resumed from update 5 ends with the uninterrupted run's checkpoint (weights and Muon's state)."""
    from test_resume_order import assert_same_run, resume, train

    data = request.getfixturevalue(data)
    extra = ["--optimizer", "muon", "--weight-decay", "0.01", "--lr", "3e-3"]
    if family == "preln_translation":
        extra += ["--update-freq", "2"]
    ref = tmp_path / "ref"
    log = train(data, family, ref, 10, *extra)
    assert "num_updates=10," in log or "num_updates 10" in log or (ref / "checkpoint_last.pt").exists(), log[-2000:]
    state = torch.load(ref / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert state["optimizer_history"][-1]["optimizer_name"] == "FairseqMuon"
    groups = [g["group"] for g in state["last_optimizer_state"]["param_groups"]]
    assert sorted(groups) == ["adamw", "muon"]
    got, log = resume(data, family, tmp_path, ref, "checkpoint_1_5.pt", 10, *extra)
    assert "Loaded checkpoint" in log, log[-2000:]
    assert_same_run(got, ref / "checkpoint_last.pt")


@pytest.mark.slow
@pytest.mark.kernel_independent
def test_two_cpu_ranks_end_equal(synthetic_bin, tmp_path):
    from test_distributed import assert_trained_identically, train_2_ranks

    proc, dumps = train_2_ranks(synthetic_bin, tmp_path, "preln_iwslt_de_en", "--optimizer", "muon")
    assert_trained_identically(proc, dumps)


@pytest.mark.slow
@pytest.mark.kernel_independent
def test_flat_fp16_is_refused_in_one_line_by_fairseq_train(synthetic_bin, tmp_path):
    out = run_cli("train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
                  "--arch", "preln_iwslt_de_en", *TINY_DIMS, "--optimizer", "muon", "--fp16", "--cpu",
                  "--max-update", "1", "--max-tokens", "500", "--save-dir", tmp_path, "--no-save",
                  "--num-workers", "0", "--disable-validation", check=False)  # fmt: skip
    assert out.returncode == 1 and "add --fp16-no-flatten-grads" in out.stdout and "Traceback" not in out.stdout
