"""Plain building blocks, each knowing no method by name and importing nothing above this package (only
torch, fairseq, :mod:`fairseq_deepinit.errors` and each other): the norm types (:mod:`.norms`), FixNorm
(:mod:`.fixnorm`), the residual modules (:mod:`.residual`), the attention on PyTorch's fused kernel and its
masks (:mod:`.attention`, :mod:`.masks`), the Linear with a norm on its input (:mod:`.linear`), one
sub-layer's norm placement (:mod:`.sublayer`), the kinds of stack (:mod:`.stacks`), the decoder input's
padding side (:mod:`.padding`), the layers with their explicit forwards (:mod:`.layers`), and what the
observing hooks and recomputes share: an attention's ``q``/``k`` and a call's arguments (:mod:`.probe`), the
autocast state (:mod:`.autocast_state`)."""
