"""What training needs beyond the model: the ``tfixup`` lr scheduler (:mod:`.tfixup_schedule`), the
``radam`` optimizer of Admin's recipes (:mod:`.radam`), ``adam_foreach``
(:mod:`.adam_foreach`: fairseq's Adam over all parameters at once), bf16 autocast for translation tasks
(:mod:`.autocast`, ``--task translation_deepinit``), fairseq's activation checkpointing recomputing under
the forward's autocast state (:mod:`.activation_checkpoint`, with :mod:`.autocast_state`)."""
