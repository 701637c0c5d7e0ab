"""Checkpoints: loading them under torch >= 2.6 with ``weights_only`` (:mod:`.compat`), writing them so
that a killed run loses nothing and resuming from the newest intact one (:mod:`.resume`)."""
