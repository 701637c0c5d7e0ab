"""``deepinit-export``: a deepinit checkpoint out of the plugin, as a stock fairseq checkpoint or a CTranslate2 model.

- :mod:`.route`: the one classification of a model (stock / fold / CTranslate2 only / refused, and why);
- :mod:`.source`: the checkpoint, its arguments and dictionaries, the plugin model rebuilt, atomic writes;
- :mod:`.fold`: every constant of the forward folded into plain weights (float64);
- :mod:`.to_fairseq`: the stock ``transformer`` / ``transformer_lm`` checkpoint and its check after writing;
- :mod:`.to_ct2`: the CTranslate2 spec, through CTranslate2's own spec classes;
- :mod:`.scoring`: teacher-forced log-probabilities of the plugin model and of CTranslate2's (the check);
- :mod:`.decoding`: fairseq-generate's decoding options as CTranslate2's, and translation of token lists;
- :mod:`.run` and :mod:`.cli`: one export start to end, and the command line.

docs/export.md has the family table, the mapping of each option to CTranslate2's spec (file:line) and the
decoding options.
"""
