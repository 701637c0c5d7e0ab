"""The Multi30k stability matrix (``scripts/multi30k_matrix.py``): the early-training matrix on the CPU
and the converged matrix (``converge`` and ``report --converged``).

- early matrix: :mod:`~deepinit_tools.matrix.common` (methods, paths, thresholds), ``cells`` (a cell's
  command, log parsing, status rules), ``decode`` (translation and BLEU), ``early_report``;
- converged matrix: ``regimes`` (each method's paper regime adapted to Multi30k, the cells and chunks),
  ``budget`` (the GPU budget estimate), ``commands`` (a cell's fairseq-train command per device),
  ``cell`` (training one cell to convergence, resumably, and its result file), ``logs``, ``plan``
  (measured packing and the plan), ``run`` and ``converge_args`` (the ``converge`` command), ``report``
  (``docs/results/converged.json`` and the generated tables of ``docs/results.md``).

The data: :func:`deepinit_tools.multi30k.prepare_bpe`; the commands: :mod:`deepinit_tools.fairseq_argv`.
"""
