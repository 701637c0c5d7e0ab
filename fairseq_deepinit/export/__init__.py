"""``deepinit-export``: a deepinit checkpoint out of the plugin, as a stock fairseq checkpoint or a CTranslate2 model.

- :mod:`.route`: the one classification of a model (stock / fold / CTranslate2 only / refused, and why), from
  its spec and the records' export declarations (:class:`fairseq_deepinit.methods.exporting.Export`);
- :mod:`.source`: the checkpoint, its arguments and spec and dictionaries, the plugin model rebuilt;
- :mod:`.fold`: every constant of the forward folded into plain weights (float64), step by declared step;
- :mod:`.omega`: Admin's omega fold (Liu et al. 2020, appendix C) and the stock model arguments;
- :mod:`.to_fairseq`: the stock ``transformer`` / ``transformer_lm`` checkpoint and its check after writing;
- :mod:`.to_ct2`: the CTranslate2 spec, through CTranslate2's own spec classes;
- :mod:`.scoring`: teacher-forced log-probabilities of the plugin model and of CTranslate2's (the check);
- :mod:`.decoding`: fairseq-generate's decoding options as CTranslate2's, and translation of token lists;
- :mod:`.hf_tokenizer`: a data folder's text pipeline (its marker) written as a Hugging Face tokenizer, whose code
  is :mod:`.hf_remote_tokenizer` (copied into the export, imported there by ``transformers`` only);
- :mod:`.run` and :mod:`.cli`: one export start to end, and the command line (and its aliases,
  ``deepinit-export-admin`` and ``deepinit-export-admin-lm``).

docs/export.md has the family table, the mapping of each option to CTranslate2's spec (file:line) and the
decoding options.
"""
