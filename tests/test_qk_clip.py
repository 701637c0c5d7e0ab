"""QK-Clip (``--qk-clip``) after real fairseq updates (``Trainer.train_step``) against the independent port of
Kimi K2's rule as Megatron-LM applies it (``tests/ports/qk_clip.py``; ``clip_with_bias`` for fairseq's biased
projections): the per-head maxima the tap keeps against ``per_head_max_logit`` on the same inputs and weights,
the clipped heads' weights and biases against the port given those maxima, unclipped heads and every other
parameter bit for bit those of the same update without the clip, ``--update-freq 2``'s max over both
micro-batches, fp32, ``--amp``, ``--fp16`` with fairseq's flat fp32 master (``torch.cuda.current_device`` stood
in for on the CPU) and without flattening, ``--memory-efficient-fp16``, both ``--attention-impl`` paths, a
language model, no host read (CPU and ``meta``), the refusals, and two CPU ranks (gloo) ending equal.

Each model has head 0 of every attention's ``q_proj`` multiplied by :data:`BOOST`, so that head 0's max logit
(27-49) exceeds :data:`TAU` and head 1's (under 2) does not. Tolerances: the maxima are recomputed by the
plugin in float32 (fp16 projections under ``--fp16``) and by the test in float64 from the same float32 (fp16)
weights and inputs: :data:`MAX_TOL`; the clip given the maxima: two ulps of the weights' dtype (``pow`` may round
differently on a vector and a scalar path).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fairseq.logging import metrics
from fairseq.modules.multihead_attention import MultiheadAttention
from ports import qk_clip as port

from conftest import TINY_DIMS, USER_DIR, run_cli, tiny_sample, tiny_trainer
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.training import qk_clip

BOOST, TAU, ALPHA = 30.0, 5.0, 0.5
MAX_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=4e-3, atol=4e-3)}


def build(kind: str, *cli: str):
    """A fairseq ``Trainer`` on the CPU for a tiny Pre-LN model (no dropout), head 0 of every q_proj boosted."""

    def boost(model) -> None:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, MultiheadAttention):
                    m.q_proj.weight[: m.head_dim] *= BOOST

    return tiny_trainer(kind, "--optimizer", "adam", *cli, before=boost)


class Recorder:
    """Every attention call's ``query`` and ``key`` (training forwards), in :class:`QKClip`'s order."""

    def __init__(self, clip: qk_clip.QKClip) -> None:
        self.calls = {name: [] for name, _a, _w in clip.attentions}
        self.handles = [
            attn.register_forward_pre_hook(self._hook(name), with_kwargs=True) for name, attn, _w in clip.attentions
        ]

    def _hook(self, name):
        def hook(module, args, kwargs):
            query = kwargs.get("query", args[0] if args else None)
            key = kwargs.get("key", args[1] if len(args) > 1 else None)
            self.calls[name].append((query.detach().clone(), None if key is None else key.detach().clone()))

        return hook


def _heads(x: torch.Tensor, weights: dict, proj: str, H: int) -> torch.Tensor:
    """``proj``'s output of ``x`` ``(T, B, C)`` in float64 as ``(B, H, T, dh)`` (the port's layout)."""
    y = F.linear(x.double(), weights[f"{proj}.weight"].double(), weights[f"{proj}.bias"].double())
    return y.view(y.size(0), y.size(1), H, -1).permute(1, 2, 0, 3)


def port_maxima(clip: qk_clip.QKClip, rec: Recorder, weights: dict) -> torch.Tensor:
    """``ports.qk_clip.per_head_max_logit`` of every recorded call, with ``weights`` (the pre-step ones), in float64,
    maxed over the calls."""
    out = []
    for name, attn, _w in clip.attentions:
        causal = attn.self_attention and name.startswith("decoder")
        per_call = [
            port.per_head_max_logit(
                _heads(query, weights, f"{name}.q_proj", attn.num_heads),
                _heads(query if attn.self_attention else key, weights, f"{name}.k_proj", attn.num_heads),
                attn.scaling,
                causal,
            )
            for query, key in rec.calls[name]
        ]
        out.append(torch.stack(per_call).amax(0))
    return torch.cat(out)


def spy(clip: qk_clip.QKClip) -> list:
    """The maxima each clip starts from (before the all-reduce and the reset)."""
    seen, factors = [], clip.factors
    clip.factors = lambda: (seen.append(clip.maxima.clone()), factors())[1]
    return seen


def weights_of(trainer, name_prefix: str = "") -> dict:
    """Every parameter as the optimizer steps it: the fp32 master where there is one, else the model's."""
    masters = qk_clip.master_weights(trainer._optimizer)
    model = trainer._model
    return {n: masters.get(id(p), p).detach().clone() for n, p in model.named_parameters()}


def one_update(kind: str, *cli: str, seeds=(0,), fp16_flat=False, monkeypatch=None, clip_cli=()):
    """The same update with and without ``--qk-clip``: ``(clipped trainer, reference trainer, clip, the plugin's
    maxima, the port's maxima)``."""
    if fp16_flat:  # FP16Optimizer's flat master asks CUDA for its device; CPU parameters have index None
        monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    t = build(kind, "--qk-clip", "--qk-clip-threshold", str(TAU), *clip_cli, *cli)
    ref = build(kind, *cli)
    t.optimizer, ref.optimizer  # noqa: B018  (built, the clip attached)
    clip = t._model.__dict__[qk_clip.ATTR]
    before = {n: p.detach().clone() for n, p in t._model.named_parameters()}
    rec, seen = Recorder(clip), spy(clip)
    samples = [tiny_sample(kind, s) for s in seeds]
    t.train_step(samples)
    ref.train_step(samples)
    assert len(seen) == 1, "one clip per update"
    return t, ref, clip, seen[0], port_maxima(clip, rec, before)


def check_clip(t, ref, clip, maxima) -> int:
    """The clipped trainer's weights: the port's clip of the reference's (given ``maxima``) for q/k, every other
    parameter and every unclipped head bit for bit the reference's; returns how many heads were clipped."""
    got, want = weights_of(t), weights_of(ref)
    params = dict(t._model.named_parameters())
    clipped = 0
    for name, attn, where in clip.attentions:
        H = attn.num_heads
        keys = [f"{name}.{proj}.{w}" for proj in ("q_proj", "k_proj") for w in ("weight", "bias")]
        wq, bq, wk, bk = port.clip_with_bias(*(want[k] for k in keys), maxima[where], H, TAU, ALPHA)
        over = maxima[where] > TAU
        clipped += int(over.sum())
        for key, expect in zip(keys, (wq, bq, wk, bk), strict=True):
            tol = dict(rtol=2 * torch.finfo(got[key].dtype).eps, atol=0)  # fp16 weights: --memory-efficient-fp16
            torch.testing.assert_close(got[key], expect.to(got[key].dtype), **tol)
            rows, ref_rows = got[key].view(H, -1), want[key].view(H, -1)
            assert torch.equal(rows[~over], ref_rows[~over]), key  # unclipped heads: bit for bit
            assert not torch.equal(rows[over], ref_rows[over]), key
            assert torch.equal(params[key].detach(), got[key].to(params[key].dtype)), key  # the model has the master
    for key in got.keys() - {f"{n}.{p}.{w}" for n, _a, _w in clip.attentions for p in ("q_proj", "k_proj")
                             for w in ("weight", "bias")}:  # fmt: skip
        assert torch.equal(got[key], want[key]), key
    return clipped


@pytest.mark.parametrize("impl", ["fairseq", "sdpa"])
def test_fp32_update_clips_heads_over_tau_as_the_port(impl):
    t, ref, clip, maxima, want = one_update("mt", "--attention-impl", impl)
    torch.testing.assert_close(maxima.double(), want, **MAX_TOL[torch.float32])
    assert len(clip.attentions) == 6 and check_clip(t, ref, clip, maxima) == 6
    assert (want[0::2] > TAU).all() and (want[1::2] < TAU).all()


def test_float64_weights_keep_unclipped_heads_bit_for_bit():
    """A float64 model: the clip computes in the weights' dtype, so an unclipped head is multiplied by exactly 1.0
    (bit for bit; rounded through float32 its rows would move by up to 2^-25 relative) and a clipped head is the
    port's float64 clip given the same maxima (``tau / S`` and its power each rounded once: two float64 ulps)."""
    model = build("mt")._model.double()
    clip = qk_clip.QKClip(model, TAU, ALPHA, cross=True)
    g = torch.Generator().manual_seed(0)
    for _name, attn, where in clip.attentions:  # head 0 of every attention over tau, the others under it
        clip.maxima[where] = torch.tensor([4 * TAU] + [TAU / 2] * (attn.num_heads - 1))
        for p in (attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias):
            p.data.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))  # not float32 values
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip.clip({})
    after = {n: p.detach() for n, p in model.named_parameters()}
    for name, attn, where in clip.attentions:
        H, maxima = attn.num_heads, clip.maxima[where].double()
        keys = [f"{name}.{proj}.{w}" for proj in ("q_proj", "k_proj") for w in ("weight", "bias")]
        want = port.clip_with_bias(*(before[k] for k in keys), maxima, H, TAU, ALPHA)
        for key, expect in zip(keys, want, strict=True):
            assert after[key].dtype == torch.float64
            torch.testing.assert_close(after[key], expect, rtol=2 * torch.finfo(torch.float64).eps, atol=0)
            rows, ref_rows = after[key].view(H, -1), before[key].view(H, -1)
            assert torch.equal(rows[1:], ref_rows[1:]), key  # unclipped heads: bit for bit
            assert not torch.equal(rows[0], ref_rows[0]), key


@pytest.mark.parametrize("cli", [("--gated-attention",), ("--attention-sinks",), ("--value-residual",)])
def test_composes_with_the_attention_features(cli):
    """Gates (after the scores), sinks (a logit that is no q.k, left out of the max) and value residuals leave
    every q.k logit as it is: the same maxima and the same clip on both paths' feature attention."""
    for impl in ("fairseq", "sdpa"):
        t, ref, clip, maxima, want = one_update("mt", *cli, "--attention-impl", impl)
        torch.testing.assert_close(maxima.double(), want, **MAX_TOL[torch.float32])
        assert check_clip(t, ref, clip, maxima) == 6


def test_language_model_and_the_logged_counts():
    with metrics.aggregate(new_root=True) as agg:
        t, ref, clip, maxima, want = one_update("lm")
        logged = agg.get_smoothed_values()
    torch.testing.assert_close(maxima.double(), want, **MAX_TOL[torch.float32])
    assert check_clip(t, ref, clip, maxima) == len(clip.attentions) > 0
    assert logged["qk_clip_heads"] == len(clip.attentions)
    assert logged["qk_clip_max_logit"] == pytest.approx(float(maxima.max()), abs=1e-3)


def test_update_freq_2_takes_the_max_over_both_micro_batches():
    t, ref, clip, maxima, want = one_update("mt", "--update-freq", "2", seeds=(0, 1))
    torch.testing.assert_close(maxima.double(), want, **MAX_TOL[torch.float32])
    single = [one_update("mt", seeds=(s,))[3] for s in (0, 1)]
    assert torch.equal(maxima, torch.maximum(*single))
    assert not torch.equal(maxima, single[0]) and not torch.equal(maxima, single[1])  # both batches count
    check_clip(t, ref, clip, maxima)


def test_each_update_starts_its_maxima_again():
    """The second update's maxima are its own forward's at its own weights (the first's are 27-49, the clip has
    brought head 0 to about tau)."""
    t = build("mt", "--qk-clip", "--qk-clip-threshold", str(TAU))
    t.optimizer  # noqa: B018
    clip = t._model.__dict__[qk_clip.ATTR]
    seen = spy(clip)
    t.train_step([tiny_sample("mt", 0)])
    before = {n: p.detach().clone() for n, p in t._model.named_parameters()}
    rec = Recorder(clip)
    t.train_step([tiny_sample("mt", 1)])
    torch.testing.assert_close(seen[1].double(), port_maxima(clip, rec, before), **MAX_TOL[torch.float32])
    assert (seen[1] < 0.5 * seen[0]).any()


def test_no_cross_leaves_the_encoder_decoder_attention():
    t, ref, clip, maxima, want = one_update("mt", clip_cli=("--no-qk-clip-cross",))
    names = [n for n, _a, _w in clip.attentions]
    assert names == [f"{s}.layers.{i}.self_attn" for s in ("encoder", "decoder") for i in (0, 1)]
    assert check_clip(t, ref, clip, maxima) == 4  # the cross-attentions' boosted heads are the reference's


@pytest.mark.parametrize("cli, flat, optimizer", [
    (("--fp16",), True, "FP16Optimizer"),
    (("--fp16", "--fp16-no-flatten-grads"), False, "FP16Optimizer"),
    (("--memory-efficient-fp16",), False, "MemoryEfficientFP16Optimizer"),
])  # fmt: skip
def test_fp16_the_clip_reaches_the_weights_the_next_step_starts_from(cli, flat, optimizer, monkeypatch):
    t, ref, clip, maxima, want = one_update("mt", *cli, fp16_flat=flat, monkeypatch=monkeypatch)
    assert type(t._optimizer).__name__ == optimizer
    assert t._optimizer.has_flat_params == flat if optimizer == "FP16Optimizer" else True
    torch.testing.assert_close(maxima.double(), want, **MAX_TOL[torch.float16])
    assert check_clip(t, ref, clip, maxima) == 6
    if optimizer == "FP16Optimizer":  # what the next step copies into the model first is the clipped master
        model = {n: p.detach().clone() for n, p in t._model.named_parameters()}
        t._optimizer._sync_fp32_params_to_fp16()
        assert all(torch.equal(p, model[n]) for n, p in t._model.named_parameters())


def test_amp_optimizer_clips_the_models_weights_in_place():
    """``--amp`` (fairseq's ``AMPOptimizer``: fp32 weights, a grad scaler, disabled on the CPU): in place."""
    t, ref, clip, maxima, want = one_update("mt", "--amp")
    assert type(t._optimizer).__name__ == "AMPOptimizer" and qk_clip.master_weights(t._optimizer) == {}
    torch.testing.assert_close(maxima.double(), want, **MAX_TOL[torch.float32])
    assert check_clip(t, ref, clip, maxima) == 6


def test_fp16_flat_master_a_clip_of_the_model_only_would_be_undone(monkeypatch):
    """The control of the test above: with the master left out the model's clip is gone after the next sync."""
    monkeypatch.setattr(qk_clip, "master_weights", lambda optimizer: {})
    t, ref, *_ = one_update("mt", "--fp16", fp16_flat=True, monkeypatch=monkeypatch)
    before = {n: p.detach().clone() for n, p in t._model.named_parameters()}
    t._optimizer._sync_fp32_params_to_fp16()
    q = "encoder.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dict(t._model.named_parameters())[q], before[q])
    assert torch.equal(dict(t._model.named_parameters())[q], dict(ref._model.named_parameters())[q])


def test_the_tap_and_the_clip_read_nothing_on_the_host():
    """The CPU standing in for the device (``deepinit_tools.harness.host_reads``): an update with QK-Clip makes
    exactly the host reads of the same update without it."""
    from deepinit_tools.harness.host_reads import HostReads

    counts = []
    for cli in (("--qk-clip", "--qk-clip-threshold", str(TAU)), ()):
        t = build("mt", *cli)
        t.optimizer  # noqa: B018
        t.train_step([tiny_sample("mt", 0)])  # warm-up (lazy state)
        with HostReads(cpu_is_device=True) as hr:
            t.train_step([tiny_sample("mt", 1)])
        counts.append([e.op for e in hr.events])
    assert counts[0] == counts[1]


# ------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "kind, cli, says",
    [
        ("mt", ("--qk-clip", "--qk-norm"), "--qk-clip does not combine with --qk-norm"),
        ("lm", ("--qk-clip", "--no-qk-clip-cross"), "--no-qk-clip-cross: this model has no encoder-decoder attention"),
        ("mt", ("--qk-clip-threshold", "50"), "--qk-clip-threshold needs --qk-clip"),
        ("mt", ("--qk-clip", "--qk-clip-threshold", "0"), "--qk-clip-threshold must be a finite number greater than 0"),
        ("mt", ("--qk-clip", "--qk-clip-alpha", "1.5"), "--qk-clip-alpha is the query's share of the factor"),
        ("mt", ("--qk-clip", "--decoder-layer-type", "matt"), "--qk-clip measures and rescales the standard"),
    ],
)
def test_refusals_at_the_build(kind, cli, says):
    with pytest.raises(DeepInitConfigError) as e:
        build(kind, *cli)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("cli, says", [
    (("--zero-sharding", "os"), "--qk-clip does not combine with --zero-sharding os"),
    (("--use-bmuf",), "--qk-clip does not combine with --use-bmuf"),
])  # fmt: skip
def test_refusals_at_the_trainer(cli, says):
    """Before fairseq builds the optimizer (fairscale's OSS, BMUF), through the plugin's hook."""
    t = build("mt", "--qk-clip", *cli)
    with pytest.raises(DeepInitConfigError) as e:
        t.optimizer  # noqa: B018
    assert says in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ CLI and ranks


@pytest.mark.slow
@pytest.mark.kernel_independent
def test_two_cpu_ranks_end_equal_after_the_clip(synthetic_bin, tmp_path):
    """Two gloo ranks on different batches, every head clipped (tau 0.01) on every update: equal bit for bit
    (each rank's own maxima would give each its own factors), the q/k weights shrunk."""
    from test_distributed import assert_trained_identically, train_2_ranks

    proc, dumps = train_2_ranks(synthetic_bin, tmp_path, "preln_iwslt_de_en", "--qk-clip", "--qk-clip-threshold",
                                "0.01")  # fmt: skip
    assert_trained_identically(proc, dumps)
    state = dumps[0]["state"]
    for attn in ("encoder.layers.0.self_attn", "decoder.layers.1.encoder_attn"):
        assert state[f"{attn}.q_proj.weight"].norm() < 0.5 * state[f"{attn}.v_proj.weight"].norm()


@pytest.mark.slow
@pytest.mark.kernel_independent
def test_fairseq_train_logs_the_clip(synthetic_bin, tmp_path):
    log = run_cli("train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
                  "--arch", "preln_iwslt_de_en", *TINY_DIMS, "--qk-clip", "--qk-clip-threshold", "0.5",
                  "--optimizer", "adam", "--lr", "1e-3", "--cpu", "--max-tokens", "500", "--max-update", "2",
                  "--log-format", "simple", "--log-interval", "1", "--num-workers", "0", "--save-dir", tmp_path,
                  "--no-save", "--disable-validation", forked=True).stdout  # fmt: skip
    assert "qk-clip(tau=0.5,alpha=0.5)" in log
    assert "qk_clip_heads" in log and "qk_clip_max_logit" in log, log[-2000:]


@pytest.mark.slow
@pytest.mark.kernel_independent
def test_the_cost_benchmark_runs_every_case(capsys):
    """benchmarks/stabiliser_cost.py on a tiny shape: every case's row; QK-Clip's update reads what plain Pre-LN's
    does on the host, z-loss's adds fairseq's read of its two logged metrics."""
    from deepinit_tools.bench import stabiliser_cost as script

    script.main(["--shape", "2x16x32x2", "--batch", "2x4", "--rounds", "1", "--updates", "1"])
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    reads = {(r[1].strip(), r[2].strip()): int(r[7]) for r in rows}
    assert set(reads) == {(m, c) for m in ("translation", "LM") for c in ("preln", "z-loss", "qk-clip")}
    for model in ("translation", "LM"):
        assert reads[model, "qk-clip"] == reads[model, "preln"]
        assert reads[model, "z-loss"] == reads[model, "preln"] + 2
    assert "Command: `" in out and "stabiliser_cost.py" in out


def test_the_tap_and_the_clip_run_on_the_meta_device_without_a_host_read():
    """On ``meta`` (which, like CUDA, refuses a CPU operand and has no data to read): the readiness benchmark's
    update with the tap attached, then the clip; nothing of QK-Clip reads the host."""
    from deepinit_tools.bench import readiness_build as rb
    from deepinit_tools.harness.fairseq_train import Shape

    b = rb.build("mt", "preln_iwslt_de_en", Shape(2, 32, 64, 2), "--qk-clip", meta=True)
    clip = qk_clip.QKClip(b.model, TAU, ALPHA, cross=True)
    assert clip.maxima.device.type == "meta"
    sample = rb.batch("mt", device="meta")
    hr = rb.reads(lambda: (rb.update(b, sample, 0), clip.clip({})), meta=True)
    assert [e for e in hr.events if "qk_clip" in e.where or "depth_" in e.where] == []
