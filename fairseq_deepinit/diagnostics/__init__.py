"""What the papers plot, measured on a model: per-sub-layer statistics collected by forward hooks
(:mod:`.hooks`), gradient flow and output change (:mod:`.stats`), the training criterion that logs
them with a divergence guard (:mod:`.criterion`) and the ``deepinit-diagnose`` tool (:mod:`.diagnose`,
plots in :mod:`.plots`)."""
