"""What training needs beyond the model: the ``tfixup`` lr scheduler (:mod:`.tfixup_schedule`), the
``radam`` optimizer of Admin's recipes (:mod:`.radam`), ``adam_foreach``
(:mod:`.adam_foreach`: fairseq's Adam over all parameters at once), ``muon`` (:mod:`.muon`: Muon and AdamW),
bf16 autocast for translation tasks
(:mod:`.autocast`, ``--task translation_deepinit``), fairseq's activation checkpointing recomputing under
the forward's autocast state (:mod:`.activation_checkpoint`, with
:mod:`fairseq_deepinit.modules.autocast_state`); the code of the
method records' training hooks (:mod:`.depth_mup_trainer`, :mod:`.qk_clip`, :mod:`.z_loss`), and the
criteria that add the records' loss terms (:mod:`.loss_terms`)."""
