"""Independent ports of the released code of the plugin's methods (reference for tests only).

Each module is written from the authors' released code (file and line cited in its docstrings, snapshot
commits in ``docs/reference/new_methods.md`` and ``docs/reference/released_code_2025.md``), imports
nothing from ``fairseq_deepinit`` and nothing from fairseq, and works on batch-first tensors ``(B, T, C)``
(fairseq's layers are time-first ``(T, B, C)``: a test transposes). ``common`` holds the plain attention /
feed-forward / norm building blocks with explicit weights that every port composes.
"""
