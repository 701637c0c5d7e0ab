"""What training needs beyond the model: the ``tfixup`` lr scheduler (:mod:`.tfixup_schedule`), the
``radam`` optimizer of Admin's recipes (:mod:`.radam`) and bf16 autocast for translation tasks
(:mod:`.autocast`, ``--task translation_deepinit``)."""
