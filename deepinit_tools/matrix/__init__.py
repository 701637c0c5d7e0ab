"""The converged Multi30k matrix (issue #17): `multi30k_matrix.py converge` and `report --converged`.

- :mod:`matrix.regimes`: each method's paper regime adapted to Multi30k, the common regime, the
  cells, the chunk table and the GPU budget estimate;
- :mod:`matrix.run`: the fairseq-train command of a cell on CPU or CUDA, training to convergence
  (patience or epoch cap), resuming, the cell's result file, packing a chunk's results into one file;
- :mod:`matrix.report`: merging result files and packs into ``docs/results/converged.json`` and the
  generated tables of ``docs/results.md``.
"""
