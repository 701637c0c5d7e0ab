"""Ready for a GPU without one: the targets of ``benchmarks/gpu_readiness.py``, asserted.

Every architecture family, translation and decoder-only, takes fairseq training updates (forward,
backward, fairseq's update, ``reduce_metrics``) on a padded batch (sources left-padded, targets
right-padded, as fairseq collates them):

- with the CPU standing in for the device, at most one host read of device data per update
  (``deepinit_tools/harness/host_reads.py: HostReads``; stock fairseq's count is in the message: one per
  encoder layer and one in the decoder);
- on the ``meta`` device, which, like CUDA, refuses a non-scalar CPU operand and has nothing to read:
  no host read by the plugin (reads answered with stand-ins and counted), and a second update with
  no stand-ins at all must run;
- under ``--attention-impl sdpa --checkpoint-activations`` and bf16 autocast: every self-attention on
  ``F.scaled_dot_product_attention``, the decoder's causal with no T x T mask, every matrix product
  of forward, recompute and backward in bf16;
- the init-only families launch at most 1.02x stock's kernels per update; the norms' kernels meet
  their targets (RMSNorm <= LayerNorm + 2, ScaleNorm <= + 3);

and MAtt's incremental decoding, Admin's profiling and the diagnostics criterion (a plain and a
diagnostic update) run on ``meta`` with the reads they are designed to make (none; the profiling
batch's cut and the profile's readout; one copy of all statistics). ``torch._dynamo.explain`` of a
training-mode forward finds one graph, no break, on both attention paths. The counters themselves
are checked against ops with known reads and dtypes. Models: 2 layers per stack, d 16 (the counts
do not depend on the width).
"""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import TINY_DIMS, build_model, make_dictionary
from deepinit_tools.bench import gpu_readiness as gr
from deepinit_tools.bench import readiness_table as rt
from deepinit_tools.bench.readiness_build import NORM_CASES, update_ops
from deepinit_tools.harness import counters
from deepinit_tools.harness.fairseq_train import Shape

gr.plugin()
from fairseq_deepinit.architectures import FAMILIES  # noqa: E402
from fairseq_deepinit.errors import DeepInitConfigError  # noqa: E402
from fairseq_deepinit.lm.architectures import LM_FAMILIES  # noqa: E402
from fairseq_deepinit.modules.hyper import ManifoldHyperConnection  # noqa: E402

SHAPE = Shape(2, 16, 32, 2)
# families that refuse --checkpoint-activations (a recomputed layer cannot read layer 1's values)
REFUSE_CHECKPOINTING = ("valueres",)
REFUSE_SDPA = ("attnsoftcap",)  # the attention logits must be materialised: fairseq's explicit path only
CASES = [pytest.param("mt", f, id=f"mt-{f}") for f in FAMILIES] + [
    pytest.param("lm", f, id=f"lm-{f}") for f in LM_FAMILIES
]


def _stock_reads(kind: str, *flags: str) -> int:
    b = gr.build(kind, gr.stock_arch(kind), SHAPE, *flags)
    sample = gr.batch(kind)
    gr.update(b, sample, 0)
    return gr.reads(lambda: gr.update(b, sample, 1), meta=False).count()


@pytest.fixture(scope="module")
def stock() -> dict:
    """Stock fairseq's host reads per update at the same shape (the figure the plugin's is set beside)."""
    return {"mt": _stock_reads("mt"), "lm": _stock_reads("lm")}


@pytest.mark.parametrize("kind,family", CASES)
def test_at_most_one_host_read_per_update_and_none_on_meta(kind, family, stock):
    fam = gr.Family(kind, family)
    b = gr.build(kind, fam.arch, SHAPE, task=fam.task)
    sample = gr.batch(kind)
    gr.update(b, sample, 0)  # Admin profiles here
    cpu = gr.reads(lambda: gr.update(b, sample, 1), meta=False)
    assert cpu.count() <= 1, f"{fam.label}: {cpu.count()} reads per update (stock: {stock[kind]}): {cpu.lines()}"

    mb = gr.build(kind, fam.arch, SHAPE, task=fam.task, meta=True)
    ms = gr.batch(kind, "meta")
    first = gr.reads(lambda: gr.update(mb, ms, 0), meta=True)
    designed = rt.ADMIN_PROFILING_READS if fam.task else 0  # Admin's profiling: its batch's cut, its readout
    assert first.count("plugin") == designed, first.lines()
    gr.update(mb, ms, 1)  # no stand-ins: a read or a CPU operand would raise


def test_stock_reads_once_per_encoder_layer_and_once_in_the_decoder(stock):
    assert stock == {"mt": SHAPE.layers + 1, "lm": 1}


def test_matt_incremental_decoding_runs_on_meta_without_reads():
    """Beam search's model calls (encoder, incremental decoder steps, state and encoder reorders)."""
    steps, beam = 3, 2
    mb = gr.build("mt", "matt_iwslt_de_en", SHAPE, meta=True)
    gr.decode(mb, gr.batch("mt", "meta"), steps, beam)  # no stand-ins
    b = gr.build("mt", "matt_iwslt_de_en", SHAPE)
    sample = gr.batch("mt")
    assert gr.reads(lambda: gr.decode(b, sample, steps, beam), meta=False).count() == 0
    sb = gr.build("mt", "transformer", SHAPE)
    stock = gr.reads(lambda: gr.decode(sb, sample, steps, beam), meta=False)
    assert stock.count() == SHAPE.layers + steps, stock.lines()  # its encoder's per layer, its decoder's per step


def test_admin_profiling_reads_twice_per_run_and_sets_omega_on_meta():
    b = gr.build("mt", "admin_iwslt_de_en", SHAPE, task="translation_admin", meta=True)
    sample = gr.batch("mt", "meta")
    hr = gr.reads(lambda: gr.update(b, sample, 0), meta=True)
    wheres = sorted(e.where.split(":")[0] for e in hr.events)
    assert wheres == ["fairseq_deepinit/admin/profiling.py", "fairseq_deepinit/admin/profiling_task.py"], hr.lines()
    from fairseq_deepinit import admin

    assert admin.is_profiled(b.model)  # the host's record: later updates read nothing
    gr.update(b, sample, 1)


@pytest.mark.parametrize("family", ["twt", "rezero"])
def test_diagnostics_criterion_reads_nothing_on_plain_updates_and_once_on_diagnostic_ones(family):
    extra = ("--criterion", "label_smoothed_cross_entropy_diagnostics", "--diagnostics-interval", "2")
    b = gr.build("mt", f"{family}_iwslt_de_en", SHAPE, *extra, meta=True)
    sample = gr.batch("mt", "meta")
    gr.update(b, sample, 0)  # a plain update: no stand-ins
    diag = gr.reads(lambda: gr.update(b, sample, 1), meta=True)
    assert [e.op for e in diag.events] == ["_to_copy"], diag.lines()  # every statistic in one copy
    cb = gr.build("mt", f"{family}_iwslt_de_en", SHAPE, *extra)
    cs = gr.batch("mt")
    assert gr.reads(lambda: gr.update(cb, cs, 0), meta=False).count() == 0


@pytest.mark.parametrize(
    "kind,family,impl",
    [("mt", "postln", "fairseq"), ("lm", "postln", "fairseq"), ("mt", "admin", "fairseq"), ("mt", "preln", "sdpa"),
     ("lm", "subln", "sdpa"), ("mt", "gatedattn", "sdpa"), ("lm", "sinks", "sdpa"), ("mt", "valueres", "fairseq"),
     ("mt", "mhc", "sdpa"), ("lm", "hc", "fairseq")],
)  # fmt: skip
def test_one_graph_without_breaks(kind, family, impl):
    """The plugin's training-mode forward compiles as one graph (fairseq's: a break per padding read);
    Admin's after an update of fairseq's training step (its residuals check their profiled flag). Under
    --attention-impl sdpa (the fast path) too: the decoder's causal self-attention is declared at build
    time, not found by reading the mask (a break per decoder layer), and Sub-LN reaches the same module. mHC's
    Sinkhorn with its recomputing backward and HC's mixing trace whole too."""
    fam = gr.Family(kind, family)
    b = gr.build(kind, fam.arch, SHAPE, "--attention-impl", impl, task=fam.task)
    sample = gr.batch(kind)
    gr.update(b, sample, 0)
    b.model.train()
    graphs, breaks = counters.graph_breaks(b.model, **sample["net_input"])
    assert (graphs, breaks) == (1, []), breaks
    if family == "postln":
        sb = gr.build(kind, gr.stock_arch(kind), SHAPE)
        _, stock_breaks = counters.graph_breaks(sb.model.train(), **sample["net_input"])
        assert stock_breaks and {br.origin for br in stock_breaks} == {"fairseq"}


# ---- what the kernels see: SDPA, causality, matmul dtypes, op counts ------------------------------


@pytest.mark.parametrize("kind,family", CASES)
def test_attention_on_sdpa_causal_and_every_matmul_bf16_with_checkpointing(kind, family):
    """Under --attention-impl sdpa --checkpoint-activations and bf16 autocast (the forward under autocast,
    the backward outside, as --autocast-bf16 runs them): every self-attention call, the recomputed ones
    included, reaches F.scaled_dot_product_attention; the decoder's pass is_causal with no T x T mask
    (targets right-padded); every matrix product of forward, recompute and backward is bf16."""
    fam = gr.Family(kind, family)
    checkpoint = ("--checkpoint-activations",)
    if family in REFUSE_SDPA:
        with pytest.raises(DeepInitConfigError, match="use --attention-impl fairseq") as e:
            gr.build(kind, fam.arch, SHAPE, "--attention-impl", "sdpa", task=fam.task)
        assert "\n" not in str(e.value)
        return
    try:
        b = gr.build(kind, fam.arch, SHAPE, "--attention-impl", "sdpa", *checkpoint, task=fam.task)
    except DeepInitConfigError as e:  # value residual refuses it, in one line; then without
        assert family in REFUSE_CHECKPOINTING and "--checkpoint-activations" in str(e), str(e)
        checkpoint = ()
        b = gr.build(kind, fam.arch, SHAPE, "--attention-impl", "sdpa", task=fam.task)
    sample = gr.batch(kind)
    gr.update(b, sample, 0)  # Admin profiles here (in fp32)
    with counters.AttentionCalls(b.model) as calls, counters.MatmulDtypeAudit(torch.bfloat16) as audit:
        gr.update(b, sample, 1, autocast=True)
    self_calls, decoder = calls.self_attention(), calls.self_attention("decoder")
    assert self_calls and all(c.path == "sdpa" for c in self_calls), self_calls
    want = 0 if family.endswith("matt") else (2 if checkpoint else 1) * SHAPE.layers  # forward and recompute
    assert len(decoder) == want and all(c.is_causal and not c.square_mask for c in decoder), decoder
    # less DyT/Derf's fp32 alpha reduction and mHC's fp32 mapping (exactly its designed products), as the column
    off = rt.model_products_off(audit, b.model, checkpoint=bool(checkpoint))
    assert audit.total() > 0 and not off, off
    mappings = sum(isinstance(m, ManifoldHyperConnection) for m in b.model.modules())
    if mappings:  # and without the model, those products show: 1 forward (+ 1 recompute), 2 backward each
        assert sum(rt.model_products_off(audit).values()) == (4 if checkpoint else 3) * mappings


@functools.cache
def _update_ops(kind: str, arch: str, *flags: str, task: str | None = None) -> int:
    """Kernels of one training update after a warm-up one, the recipes' dropouts on (gpu_readiness.py)."""
    return update_ops(kind, arch, SHAPE, *flags, task=task)[0].total


@pytest.mark.parametrize("kind,family", [(k, f) for k in ("mt", "lm") for f in gr.OP_TARGETED])
def test_init_only_families_launch_at_most_2_percent_more_ops_than_stock(kind, family):
    """Kernels per training update against stock fairseq at its norm position: the init-only families run
    stock's modules, and the methods that only move or rescale its computation (reordered, Mix-LN,
    depth-muP, CompleteP) add none: at most 1.02x its ops (the 6-layer figures: docs/benchmarks.md)."""
    fam = gr.Family(kind, family)
    b = gr.build(kind, fam.arch, SHAPE, task=fam.task)
    plugin = _update_ops(kind, fam.arch, task=fam.task)
    stock = _update_ops(kind, gr.stock_arch(kind), *gr.stock_flags(b))
    assert plugin <= rt.OP_TARGET * stock, (plugin, stock, plugin / stock)


def test_norm_kernels_meet_their_targets():
    """The readiness table's norm rows (on meta, as CUDA launches them): RMSNorm <= LayerNorm + 2,
    ScaleNorm <= + 3, in fp16, fp32 and CUDA autocast's mixed dtypes."""
    rows = gr.norm_kernels()
    assert {r["dtype"] for r in rows} == {label for label, *_ in NORM_CASES}
    assert all(r["ok"] for r in rows if r["limit"] is not None), rows


# ---- the same model as fairseq's at every real position --------------------------------------------

NO_DROPOUT = ("--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0")


def _padded(left_pad_target: bool, src_padding: bool) -> tuple:
    """fairseq's collation of four sentences; ``src_padding=False``: sources of one length (no pad)."""
    from fairseq.data import data_utils

    d = make_dictionary()
    g = torch.Generator().manual_seed(3)

    def sents(lengths):
        return [torch.cat([torch.randint(4, 50, (n,), generator=g), torch.tensor([d.eos()])]) for n in lengths]

    src = sents((7, 5, 6, 3) if src_padding else (6, 6, 6, 6))
    tgt = sents((6, 4, 8, 5))
    net = {
        "src_tokens": data_utils.collate_tokens(src, d.pad(), d.eos(), left_pad=True),
        "src_lengths": torch.tensor([len(t) for t in src]),
        "prev_output_tokens": data_utils.collate_tokens(
            tgt, d.pad(), d.eos(), left_pad=left_pad_target, move_eos_to_beginning=True
        ),
    }
    return net, data_utils.collate_tokens(tgt, d.pad(), d.eos(), left_pad=left_pad_target), d.pad()


def _outputs_and_grads(model, net: dict, target: torch.Tensor, pad: int) -> tuple:
    from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

    model.zero_grad(set_to_none=True)
    logits = model(**net)[0]
    lprobs = torch.log_softmax(logits.float(), dim=-1)
    loss, _ = label_smoothed_nll_loss(lprobs.view(-1, lprobs.size(-1)), target.view(-1), 0.1, ignore_index=pad)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.numerics
@pytest.mark.parametrize("left_pad_target", [False, True], ids=["right-padded", "left-padded"])
@pytest.mark.parametrize("src_padding", [True, False], ids=["padded-src", "unpadded-src"])
def test_without_padding_reads_the_model_is_fairseqs_at_every_real_position(left_pad_target, src_padding):
    """The encoder's mask on every layer and the decoder's padding decided by the task give fairseq's
    outputs at every real target position, its loss and its gradients (fp32; same weights).

    Each side computes the same sums in the same order, except that attention takes its mask as one
    more (zero) addend, and masked and unmasked calls may take different CPU kernels: differences are
    float32 round-off of a softmax over a few keys, ~1e-7 relative; 1e-5 leaves room for every kernel path.
    """
    flags = (*(["--left-pad-target"] if left_pad_target else []), *TINY_DIMS, *NO_DROPOUT)
    stock, _ = build_model("transformer", *flags)
    plugin, _ = build_model("postln_iwslt_de_en", *flags)
    plugin.load_state_dict(stock.state_dict())
    assert plugin.decoder.target_padding == ("left" if left_pad_target else "right")
    net, target, pad = _padded(left_pad_target, src_padding)
    real = net["prev_output_tokens"].ne(pad)
    want, got = (_outputs_and_grads(m.train(), net, target, pad) for m in (stock, plugin))
    torch.testing.assert_close(got[0][real], want[0][real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=1e-5, msg=name)

    # the control: claiming right padding for left-padded targets lets real positions see padding
    if left_pad_target:
        plugin.decoder.target_padding = "right"
        wrong = _outputs_and_grads(plugin, net, target, pad)[0]
        assert not torch.allclose(wrong[real], want[0][real], rtol=1e-3, atol=1e-3)


# ---- the counters themselves --------------------------------------------------------------------


def test_host_reads_counts_device_reads_and_not_host_made_tensors():
    x = torch.randn(4)
    with counters.HostReads() as hr:
        bool(x.sum() > 0)  # a read
        _ = x[x > 0]  # boolean indexing: a read of the mask
        torch.equal(x, x)  # a read
        shape = torch.tensor([3, 4])  # made on the host from Python numbers
        bool(shape[0] > 2)  # not a read of the device
        x.cumsum(0)  # no read
    assert [e.op for e in hr.events] == ["_local_scalar_dense", "index", "equal"]
    assert {e.origin for e in hr.events} == {"other"} and "test_gpu_readiness.py" in hr.events[0].where
    m = torch.randn(4, device="meta")
    with counters.HostReads(cpu_is_device=False, stand_in=True) as hr:
        assert float(m.sum()) == 1.0 and m.tolist() == [1.0] * 4  # stand-ins
    assert [e.op for e in hr.events] == ["_local_scalar_dense", "_to_copy"]


def test_matmul_audit_takes_attention_in_its_input_dtype():
    """SDPA counts as one product each way in its inputs' dtype (the CPU's math fallback, which dropout
    takes, upcasts to fp32 inside), also when forward and backward are audited apart; an SDPA call on
    fp32 inputs and a plain fp32 product are found, with the line that asked."""
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.autocast("cpu", dtype=torch.bfloat16), counters.MatmulDtypeAudit() as fwd:
        out = torch.nn.functional.scaled_dot_product_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), dropout_p=0.5)
        (q @ q.transpose(-1, -2)).sum()  # bf16 under autocast
    assert torch.nn.functional.scaled_dot_product_attention is sdpa  # restored
    with counters.MatmulDtypeAudit() as bwd:
        out.float().sum().backward()
    assert fwd.other() == bwd.other() == 0
    assert fwd.counts[("scaled_dot_product_attention", torch.bfloat16)] == 1
    assert dict(bwd.counts) == {("scaled_dot_product_attention_backward", torch.bfloat16): 1}, bwd.summary()
    with counters.MatmulDtypeAudit() as audit:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)  # fp32 (outside autocast)
    with counters.MatmulDtypeAudit() as plain:
        q @ q.transpose(-1, -2)
    assert audit.other() == plain.other() == 1
    ((line, n),) = plain.off.items()
    assert n == 1 and line.startswith("other bmm tests/test_gpu_readiness.py:"), line


def test_matmul_audit_counts_attention_no_fused_cuda_kernel_takes_as_its_fp32_math():
    """CUDA's fused kernels want q, k (and for flash v) of one head width, divisible by 8 in bf16 (torch
    sdp_utils.cpp); a call outside those rules runs the math backend, which upcasts bf16 to fp32: the audit counts
    it operator by operator (2 fp32 products forward, 4 backward), and a width-8 call as the one bf16 kernel."""
    x = torch.randn(1, 2, 4, 16, requires_grad=True)
    # (q, k, v widths) -> fp32 products forward, backward: flash takes one width <= 256, efficient widths % 8
    cases = {(9, 9, 8): (2, 4), (12, 12, 8): (2, 4), (12, 12, 12): (0, 0), (8, 8, 8): (0, 0), (16, 16, 8): (0, 0)}
    for widths, fp32 in cases.items():
        q, k, v = (x[..., :w].bfloat16() for w in widths)
        with torch.autocast("cpu", dtype=torch.bfloat16), counters.MatmulDtypeAudit() as fwd:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        with counters.MatmulDtypeAudit() as bwd:
            out.float().sum().backward()
        assert (fwd.other(), bwd.other()) == fp32, (widths, fwd.summary(), bwd.summary())
        assert fwd.total(torch.bfloat16) == (0 if fp32[0] else 1), (widths, fwd.summary())


def test_an_op_passed_on_by_a_torch_mode_is_the_callers():
    """A recorder's TorchFunctionMode (gpu_smoke's SDPA recorder) sits between the model and the op: the audit
    names the line that asked for the product, not the mode's handler."""
    from torch.overrides import TorchFunctionMode

    class PassOn(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q = torch.randn(2, 3)
    with PassOn(), counters.MatmulDtypeAudit() as audit:
        q @ q.t()
    ((line, n),) = audit.off.items()
    assert n == 1 and line.startswith("other mm tests/test_gpu_readiness.py:") and "(test_an_op_passed" in line, line
