"""What the papers plot, measured on a model: per-sub-layer statistics collected by forward hooks
(:mod:`.hooks`), gradient flow and output change (:mod:`.stats`), the training criterion that logs them
(:mod:`.criterion`) with its divergence guard (:mod:`.guard`) and its two taps into fairseq's training
loop (:mod:`.taps`), and the ``deepinit-diagnose`` tool (:mod:`.diagnose`, measurements in
:mod:`.measure`, plots in :mod:`.plots`)."""
