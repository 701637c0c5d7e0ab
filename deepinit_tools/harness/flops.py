"""Model FLOPs of an encoder-decoder Transformer training step, and model FLOPs utilisation (MFU).

Closed form, the convention of Kaplan et al. 2020 ("Scaling Laws for Neural Language Models",
sec. 2.1: C = 6N FLOPs per token for forward + backward, N = non-embedding parameters) and of
Chowdhery et al. 2022 (PaLM, appendix B: 6N + 12 L H Q T per token, the second term being the
attention score and value products, ``H * Q = d``). Forward: 2 FLOPs per weight per token that
the weight multiplies; backward: twice the forward. Applied to an encoder-decoder model, each
weight is counted against the tokens it actually sees:

- encoder layer (self-attention q, k, v, o: 4 d^2; FFN: 2 d f) on every source token;
- decoder layer: self-attention 4 d^2, cross-attention q and o 2 d^2 and FFN 2 d f on every target
  token; cross-attention k and v (2 d^2) on the encoder output, i.e. every source token;
- the output projection (d x V_tgt) on every target token: a real matrix product even though its
  weights are (or are tied to) an embedding; the input embeddings are look-ups, 0 FLOPs;
- attention: ``Q K^T`` and ``A V``, 2 * 2 * d * len_q * len_k forward per layer and sentence,
  times 3 for forward + backward (PaLM's 12 L d T per token, with T the key length), no discount
  for the causal mask (as PaLM), true lengths without padding.

Biases, norms, softmax, dropout and the loss are left out (under 1 % at d = 512); padding is not
model work, so MFU counts only real tokens. MFU = model FLOPs per second / the device's dense
bf16 tensor-core peak (fp16 has the same peak on these devices).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

# dense (no 2:4 sparsity) bf16 tensor-core peaks in FLOP/s, from NVIDIA's data sheets; matched
# against torch.cuda.get_device_name() in order, the first rule whose words all occur wins
PEAK_BF16: Tuple[Tuple[Tuple[str, ...], float, str], ...] = (
    (("H200",), 989e12, "H200 (SXM): 989 TFLOP/s dense bf16"),
    (("H100", "PCIE"), 756e12, "H100 PCIe: 756 TFLOP/s dense bf16"),
    (("H100", "HBM3"), 989e12, "H100 SXM (80GB HBM3): 989 TFLOP/s dense bf16"),
    (("H100", "SXM"), 989e12, "H100 SXM: 989 TFLOP/s dense bf16"),
    (("A100",), 312e12, "A100: 312 TFLOP/s dense bf16"),
)


@dataclasses.dataclass(frozen=True)
class Dims:
    """Shape of an encoder-decoder Transformer (same layer dims in both stacks)."""

    enc_layers: int
    dec_layers: int
    dim: int
    ffn: int
    tgt_vocab: int


@dataclasses.dataclass(frozen=True)
class BatchLengths:
    """True (unpadded) lengths of every sentence of a batch: source and target, pairwise."""

    src: Sequence[int]
    tgt: Sequence[int]

    @classmethod
    def of_sample(cls, sample: dict, pad: int) -> BatchLengths:
        """From a fairseq translation sample (``net_input.src_lengths`` and the padded ``target``)."""
        src = sample["net_input"]["src_lengths"].tolist()
        tgt = sample["target"].ne(pad).sum(1).tolist()
        return cls(src, tgt)


def weight_flops_per_token(d: Dims) -> Tuple[int, int]:
    """(FLOPs per source token, FLOPs per target token) of the weight products, forward + backward."""
    src_weights = d.enc_layers * (4 * d.dim**2 + 2 * d.dim * d.ffn) + d.dec_layers * 2 * d.dim**2
    tgt_weights = d.dec_layers * (4 * d.dim**2 + 2 * d.dim**2 + 2 * d.dim * d.ffn) + d.dim * d.tgt_vocab
    return 6 * src_weights, 6 * tgt_weights


def attention_flops(d: Dims, lengths: BatchLengths) -> int:
    """Forward + backward FLOPs of the attention products of one batch (12 d len_q len_k per layer)."""
    total = 0
    for s, t in zip(lengths.src, lengths.tgt, strict=True):
        total += d.enc_layers * s * s + d.dec_layers * (t * t + t * s)
    return 12 * d.dim * total


def step_flops(d: Dims, lengths: BatchLengths) -> int:
    """Model FLOPs of one training step (forward + backward) on a batch."""
    per_src, per_tgt = weight_flops_per_token(d)
    return per_src * sum(lengths.src) + per_tgt * sum(lengths.tgt) + attention_flops(d, lengths)


def peak_flops(device_name: str) -> Tuple[float | None, str]:
    """(dense bf16 peak FLOP/s, where it comes from) for a CUDA device name; (None, why) if unknown."""
    upper = device_name.upper()
    for words, peak, source in PEAK_BF16:
        if all(w in upper for w in words):
            return peak, source
    return None, f"no dense bf16 peak known for {device_name!r}: mfu is null"


def mfu(flops_per_s: float, device_name: str) -> float | None:
    """Model FLOPs utilisation: ``flops_per_s`` over the device's dense bf16 peak (None if unknown)."""
    peak, _ = peak_flops(device_name)
    return None if peak is None else flops_per_s / peak
