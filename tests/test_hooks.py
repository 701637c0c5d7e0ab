"""The residual-statistics hooks measure exactly the tensors the residual modules sum."""

import torch

from conftest import build_model, tiny_batch
from fairseq_deepinit.diagnostics.hooks import ResidualStatistics


def test_hooks_match_by_hand_moments():
    model, _ = build_model(
        "deepinit_tiny", "--dropout", "0", "--residual-scale", "deepnorm", "--init-scheme", "deepnorm"
    )
    model.eval()
    seen = {}

    def spy(name):
        def hook(module, inputs, output):
            seen[name] = (inputs[0].detach().double(), module.scaled_skip(inputs[1]).detach().double(), output.detach())

        return hook

    handles = [m.register_forward_hook(spy(n)) for n, m in ResidualStatistics(model).modules.items()]
    with ResidualStatistics(model) as stats:
        model(**tiny_batch())
    for h in handles:
        h.remove()
    var = stats.variances()
    assert len(var) == 2 * 2 + 2 * 3  # encoder: 2 sub-layers x 2 layers; decoder: 3 x 2
    assert list(var)[0] == "encoder.layers.0.self_attn" and list(var)[-1] == "decoder.layers.1.ffn"
    for name, (branch, skip, out) in seen.items():
        short = name.replace(".residuals.", ".")
        assert abs(var[short]["branch"] - branch.var(unbiased=False).item()) < 1e-9
        assert abs(var[short]["skip"] - skip.var(unbiased=False).item()) < 1e-9
        torch.testing.assert_close(out.double(), branch + skip)
    # DeepNorm scales the skip term by alpha: the recorded skip is alpha * x_{i-1}, not x_{i-1}
    mod = ResidualStatistics(model).modules["encoder.layers.0.residuals.self_attn"]
    assert mod.alpha > 1.0


def test_hooks_detach_and_accumulate():
    model, _ = build_model("deepinit_tiny", "--dropout", "0")
    model.eval()
    stats = ResidualStatistics(model)
    with stats:
        model(**tiny_batch(seed=0))
        model(**tiny_batch(seed=1))
    n_two = stats.variances()["encoder.layers.0.ffn"]["count"]
    model(**tiny_batch(seed=2))  # detached: not counted
    assert stats.variances()["encoder.layers.0.ffn"]["count"] == n_two == 2 * 3 * 7 * 64
