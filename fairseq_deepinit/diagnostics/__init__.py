"""What the papers plot, measured on a model: per-sub-layer statistics collected by forward hooks
(:mod:`.hooks`), gradient flow and output change (:mod:`.stats`), the training criterion that logs them
(:mod:`.criterion`, its options in :mod:`.criterion_config`) with its divergence guard (:mod:`.guard`)
and its two taps into fairseq's training loop (:func:`fairseq_deepinit.patches.install_task_mixin`,
:func:`fairseq_deepinit.patches.wrap_optimizer`), and the ``deepinit-diagnose`` tool
(:mod:`.diagnose`, measurements in :mod:`.measure`, plots in :mod:`.plots`). Statistics over depth
(residual stream, angular distance, max attention logit: :mod:`.depth_stats`, :mod:`.depth_hooks`, the
criterion's part in :mod:`.depth_criterion`), instability counters (:mod:`.training_counters`), the loss
with one layer removed (:mod:`.layer_removal`) and their ``deepinit-diagnose`` measures and plots
(:mod:`.depth_diagnose`, :mod:`.depth_plots`)."""
