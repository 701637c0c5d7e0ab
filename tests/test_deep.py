"""Every scheme trains at depth: no unused parameter (DDP), no norm under T-Fixup, and a 60+60-layer
model (d=64, FFN 128, 2 heads; T-Fixup Fig. 4b's width) has a finite loss and a non-zero gradient
in every layer after one forward/backward on a tiny batch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_DIMS, build_model, tiny_batch
from fairseq_deepinit.modules.norms import is_norm
from fairseq_deepinit.modules.residual import ReZeroResidual

PRE = ("--encoder-normalize-before", "--decoder-normalize-before")
CONFIGS = {
    "fairseq": ("--init-scheme", "fairseq"),
    "xavier-postln": ("--init-scheme", "xavier"),
    "xavier-preln": ("--init-scheme", "xavier", *PRE),
    "lipschitz": ("--init-scheme", "lipschitz"),
    "lipschitz-bias-free": ("--init-scheme", "lipschitz", "--lipschitz-bias-free"),
    "t-fixup": ("--init-scheme", "t-fixup"),
    "ds-init-paper": ("--init-scheme", "ds-init"),
    "ds-init-code": ("--init-scheme", "ds-init", "--ds-init-variant", "code", "--ds-init-alpha", "0.5"),
    "smallinit-preln": ("--init-scheme", "smallinit", *PRE),
    "twt": (
        "--init-scheme",
        "smallinit",
        "--norm-type",
        "scalenorm",
        "--fixnorm",
        "--share-decoder-input-output-embed",
        *PRE,
    ),  # fmt: skip
    "rmsnorm-preln": ("--norm-type", "rmsnorm", *PRE),
    "deepnorm": ("--init-scheme", "deepnorm"),
    "rezero": ("--init-scheme", "rezero"),
    "rezero+postln": ("--init-scheme", "rezero+postln"),
}

# k_proj's bias adds q.b_k to every score of a query: softmax is invariant to that shift, so its
# gradient is zero in exact arithmetic (float round-off only). It is still in the graph (not unused).
ZERO_GRAD_BY_MATH = ("k_proj.bias",)


def loss_and_backward(model, seed: int = 0) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    batch = tiny_batch(seed=seed)
    logits, _ = model(**batch)
    target = torch.randint(4, 54, logits.shape[:2], generator=torch.Generator().manual_seed(seed))
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))
    loss.backward()
    return loss


def _set_rezero(model, value: float) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ReZeroResidual):
                m.alpha.fill_(value)


def test_tfixup_has_no_norm_anywhere():
    for extra in ((), PRE):  # Pre-LN flags must not bring back a final norm either
        model, args = build_model("deepinit_tiny", "--init-scheme", "t-fixup", *extra)
        assert args.norm_type == "none"
        assert not [n for n, m in model.named_modules() if is_norm(m)]
        assert not [n for n, _ in model.named_parameters() if "norm" in n]
        assert model.encoder.layer_norm is None and model.decoder.layer_norm is None
        assert model.encoder.layernorm_embedding is None and model.decoder.layernorm_embedding is None


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_unused_parameter(name):
    """After one backward every parameter has a gradient (DDP without find_unused_parameters), and
    a non-zero one, except where the math makes it zero (k bias; ReZero's branches while a = 0)."""
    model, _ = build_model("deepinit_tiny", "--dropout", "0", *CONFIGS[name])
    loss = loss_and_backward(model)
    assert torch.isfinite(loss)
    params = dict(model.named_parameters())
    unused = [n for n, p in params.items() if p.grad is None]
    assert not unused, f"parameters outside the graph: {unused}"
    rezero = any(isinstance(m, ReZeroResidual) for m in model.modules())
    if rezero:
        # a = 0: only the decoder's a get a gradient at step 0 (the encoder is cut off by the
        # cross-attention's a = 0); with a != 0 every parameter learns
        for n, p in params.items():
            if n.startswith("decoder.layers.") and n.endswith(".alpha"):
                assert torch.count_nonzero(p.grad) > 0, n
        _set_rezero(model, 0.5)
        loss_and_backward(model)
    zero = [n for n, p in params.items() if torch.count_nonzero(p.grad) == 0 and not n.endswith(ZERO_GRAD_BY_MATH)]
    assert not zero, f"parameters with an all-zero gradient: {zero}"
    for n, p in params.items():
        assert torch.isfinite(p.grad).all(), n
        if n.endswith(ZERO_GRAD_BY_MATH):
            assert p.grad.abs().max() < 1e-5, f"{n}: softmax shift invariance should make this ~0"


def _layer_grad_norms(model):
    out = {}
    for stack in ("encoder", "decoder"):
        for i, layer in enumerate(getattr(model, stack).layers):
            grads = [p.grad for p in layer.parameters() if p.grad is not None]
            out[f"{stack}.{i}"] = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads)) if grads else 0.0
    return out


DEEP = [
    "--encoder-layers", "60", "--decoder-layers", "60",
    "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
    "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_60_layers_finite_loss_and_gradient_in_every_layer(name):
    model, args = build_model("deepinit_tiny", "--dropout", "0", *DEEP, *CONFIGS[name])
    assert len(model.encoder.layers) == len(model.decoder.layers) == 60
    loss = loss_and_backward(model)
    assert torch.isfinite(loss), f"{name}: loss {loss}"
    # a random 60-layer model should start near the uniform loss log(V), not at 1e3
    assert loss.item() < 10 * math.log(model.decoder.output_projection.weight.size(0))
    if args.residual_scale == "rezero":
        # at a = 0 the stack is the identity and the encoder gets no gradient; after one SGD step on
        # the decoder's a, the gradient reaches every layer
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
        loss = loss_and_backward(model)
        assert torch.isfinite(loss)
    norms = _layer_grad_norms(model)
    dead = [k for k, v in norms.items() if not v > 0.0]
    bad = [k for k, v in norms.items() if not math.isfinite(v)]
    assert not bad, f"{name}: non-finite gradient in {bad}"
    assert not dead, f"{name}: no gradient in {dead}"


def test_tiny_dims_are_what_conftest_says():
    # the tiny CLI dims and deepinit_tiny agree (tests above rely on d=64, 2 heads)
    model, _ = build_model("deepinit_tiny", *TINY_DIMS)
    assert model.encoder.layers[0].self_attn.num_heads == 2 and model.encoder.layers[0].fc1.out_features == 128
