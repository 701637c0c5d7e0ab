"""Depth-muP (Yang et al. 2023, Tensor Programs VI: alpha = 1/2) and CompleteP (Dey et al. 2025: alpha = 1).

With ``m_L = L / L_base`` (depth multiplier) and width multiplier ``m_N = d / d_base`` (1 in this project,
which scales depth only), every residual branch of a Pre-LN block is multiplied by ``m_L ** -alpha`` and
the optimiser is re-parameterised per parameter group. Three released sources, kept apart because they
differ:

- ``"paper"``: CompleteP Table 1 (shipped as ``assets/parameterization_summary.png`` on the ``completep``
  branch of EleutherAI/nanoGPT-mup, commit 6f8bc3b): hidden (all linear layers in the backbone) and their
  biases and the blocks' pre-LN gains get LR ``eta * m_L ** (alpha - 1)`` (hidden weights also ``/ m_N``);
  AdamW eps of the residual blocks ``eps * m_N**-1 * m_L**-alpha``; embeddings, final LN and unembedding
  keep ``eta`` and ``eps``; init variances do not depend on depth (hidden ``sigma**2 / m_N``);
- ``"nanogpt"``: the paper's minimal implementation, nanoGPT-mup ``completep`` ``model.py``:
  ``residual_scaling = 1 / depth_multiplier ** depth_alpha_exp`` (``113``, used at ``116-119``);
  ``configure_optimizers`` (``305-363``) groups: embeddings ``lr_scale 1``, hidden LN ``m_L ** (alpha-1)``,
  hidden weights ``m_N**-1 * m_L**(alpha-1)`` with ``weight_decay / m_N**-1``, hidden biases
  ``m_L ** (alpha-1)``, final LN ``1``; **one** AdamW eps for all groups,
  ``adam_eps *= m_N**-1 * m_L**-alpha`` (``335``); ``train.py:299``: ``lr = lr * lr_scale``; init
  (``167-177``) ``init_std / sqrt(m_N)`` for every hidden matrix, no ``1/sqrt(2L)`` when muP is on;
- ``"megatron"``: NVIDIA/Megatron-LM PR #4999 (``[3/4] Hyperparameter Transfer: add dense GPT depth-MuP
  recipe``), ``scaling_recipe='depth_mup'``, alpha fixed to 1: ``residual_branch_depth_power = -1``,
  ``hidden_lr_depth_power = 0``, ``block_out_proj_init_depth_power = +0.5`` (recipe defaults in the
  scaling spec ``build_scaling_context``), hidden (matrix-like, non-embedding) Adam eps
  ``eps / m_N * m_L**-1`` (``ResolvedTrainingPolicy.hidden_eps_multiplier``), biases and norms
  ("vector-like") and embedding/output keep base LR and eps; dense block output projections init
  ``sigma / sqrt(2 L) / sqrt(m_N) * m_L**0.5`` = ``sigma / sqrt(2 L_base) / sqrt(m_N)``
  (``dense_block_output_init_method``); the residual multiplier also scales the branch's bias
  (``scale_residual_branch_output``). Only Adam/AdamW (``__post_init__`` rejects SGD and Muon).
  These files are read from the code index (no repository path given; index ids in
  ``docs/reference/new_methods.md``).
"""

from __future__ import annotations

import math

GROUPS = ("embedding", "hidden_weight", "hidden_bias", "hidden_norm", "final_norm", "output")
SOURCES = ("paper", "nanogpt", "megatron")


def depth_multiplier(n_layers: int, base_layers: int) -> float:
    if n_layers <= 0 or base_layers <= 0:
        raise ValueError("layer counts must be positive")
    return n_layers / base_layers


def branch_multiplier(n_layers: int, base_layers: int, alpha: float) -> float:
    """``m_L ** -alpha`` (nanoGPT-mup ``model.py:113``; Megatron ``residual_branch_multiplier``)."""
    return depth_multiplier(n_layers, base_layers) ** -alpha


def group_scales(
    n_layers: int,
    base_layers: int,
    alpha: float,
    source: str = "paper",
    width_mult: float = 1.0,
) -> dict[str, dict[str, float]]:
    """Multipliers of the base ``lr``, Adam ``eps`` and ``weight_decay`` per parameter group.

    ``weight_decay`` is the factor on the base value as the optimiser receives it (PyTorch AdamW multiplies
    it by the group's lr); groups the source leaves without decay get 0.
    """
    if not 0.5 <= alpha <= 1.0:
        raise ValueError("alpha is defined in [0.5, 1] (Table 1: {0.5, 1}; nanoGPT-mup model.py:140)")
    m_l = depth_multiplier(n_layers, base_layers)
    m_n = width_mult
    depth_lr = m_l ** (alpha - 1)
    block_eps = (1 / m_n) * m_l**-alpha
    if source == "paper":
        return {
            "embedding": {"lr": 1.0, "eps": 1.0, "weight_decay": 1.0},
            "hidden_weight": {"lr": depth_lr / m_n, "eps": block_eps, "weight_decay": m_n},
            "hidden_bias": {"lr": depth_lr, "eps": block_eps, "weight_decay": 1.0},
            "hidden_norm": {"lr": depth_lr, "eps": block_eps, "weight_decay": 1.0},
            "final_norm": {"lr": 1.0, "eps": 1.0, "weight_decay": 1.0},
            "output": {"lr": 1.0, "eps": 1.0, "weight_decay": 1.0},
        }
    if source == "nanogpt":
        return {
            "embedding": {"lr": 1.0, "eps": block_eps, "weight_decay": 1.0},
            "hidden_weight": {"lr": depth_lr / m_n, "eps": block_eps, "weight_decay": m_n},
            "hidden_bias": {"lr": depth_lr, "eps": block_eps, "weight_decay": 0.0},
            "hidden_norm": {"lr": depth_lr, "eps": block_eps, "weight_decay": 0.0},
            "final_norm": {"lr": 1.0, "eps": block_eps, "weight_decay": 0.0},
            # tied with the embedding in nanoGPT (model.py:162)
            "output": {"lr": 1.0, "eps": block_eps, "weight_decay": 1.0},
        }
    if source == "megatron":
        if alpha != 1.0:
            raise ValueError("Megatron's depth_mup recipe fixes alpha = 1 (residual_branch_depth_power = -1)")
        return {
            "embedding": {"lr": 1.0, "eps": 1.0, "weight_decay": 1.0},
            "hidden_weight": {"lr": 1.0 / m_n, "eps": (1 / m_n) * m_l**-1, "weight_decay": 1.0},
            "hidden_bias": {"lr": 1.0, "eps": 1.0, "weight_decay": 1.0},
            "hidden_norm": {"lr": 1.0, "eps": 1.0, "weight_decay": 1.0},
            "final_norm": {"lr": 1.0, "eps": 1.0, "weight_decay": 1.0},
            "output": {"lr": 1.0, "eps": 1.0, "weight_decay": 1.0},
        }
    raise ValueError(f"unknown source {source!r}")


def block_out_init_std(
    sigma: float, n_layers: int, base_layers: int, source: str = "paper", width_mult: float = 1.0
) -> float:
    """Init std of a block's output projection (attention out, FFN down)."""
    if source in ("paper", "nanogpt"):
        return sigma / math.sqrt(width_mult)
    if source == "megatron":
        m_l = depth_multiplier(n_layers, base_layers)
        return sigma / math.sqrt(2.0 * n_layers) / math.sqrt(width_mult) * m_l**0.5
    raise ValueError(f"unknown source {source!r}")


def residual_add(x, branch_out, n_layers: int, base_layers: int, alpha: float):
    """``x + m_L**-alpha * F(...)`` (nanoGPT-mup ``model.py:117-118``)."""
    return x + branch_multiplier(n_layers, base_layers, alpha) * branch_out


def stack_multipliers(
    encoder_layers: int, decoder_layers: int, encoder_base: int, decoder_base: int, alpha: float
) -> tuple[float, float]:
    """Encoder-decoder translation (this project's extension): each stack has its own ``m_L``; every
    sub-layer of a decoder layer (self-attention, cross-attention, FFN) gets the decoder's multiplier."""
    return (
        branch_multiplier(encoder_layers, encoder_base, alpha),
        branch_multiplier(decoder_layers, decoder_base, alpha),
    )
