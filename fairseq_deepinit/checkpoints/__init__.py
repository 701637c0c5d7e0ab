"""Checkpoints: loading them under torch >= 2.6 with ``weights_only`` and refusing hostile files (:mod:`.compat`,
:mod:`.integrity`), writing them so that a kill or a failed save loses nothing (:mod:`.atomic`) and resuming from
the newest intact one (:mod:`.resume`)."""
