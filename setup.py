"""fairseq-deepinit: deep-Transformer initialisation and normalisation schemes for fairseq."""

from setuptools import find_namespace_packages, find_packages, setup

setup(
    name="fairseq-deepinit",
    version="0.2.0.dev0",
    description=(
        "A fairseq --user-dir plugin with the published fixes for deep Transformer training: "
        "Lipschitz init, T-Fixup, Admin, DS-Init/MAtt, Transformers without Tears, DeepNorm, ReZero."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11,<3.13",
    # the plugin only: the research tools (deepinit_tools/: benchmarks, Multi30k matrix, readiness, GPU
    # session) run from a checkout; their scripts put it first on the path (README, "Research tools")
    packages=find_packages(include=["fairseq_deepinit", "fairseq_deepinit.*"])
    # fairseq-hydra-train's config-key errors in one line: Hydra imports this namespace at start-up
    + find_namespace_packages(include=["hydra_plugins"]),
    install_requires=[
        # exact pins; ve-fairseq's wheel hashes are in requirements/fairseq.txt
        "ve-fairseq==0.12.3",
        "torch==2.13.0",
        "sacrebleu==2.6.0",
        "subword-nmt==0.3.8",
        "matplotlib==3.11.2",  # deepinit-diagnose plots
        "tensorboardX==2.6.5",  # --tensorboard-logdir (fairseq falls back to it without `tensorboard`)
    ],
    extras_require={"test": ["pytest==9.0.3", "pytest-xdist==3.8.0", "ruff==0.17.6"]},
    entry_points={
        "console_scripts": [
            "deepinit-compare = fairseq_deepinit.compare.cli:main",
            "deepinit-diagnose = fairseq_deepinit.diagnostics.diagnose:main",
            "deepinit-export = fairseq_deepinit.export.cli:main",
            # aliases of deepinit-export --to fairseq, narrowed to Admin models (fairseq_deepinit.export.cli.Alias)
            "deepinit-export-admin = fairseq_deepinit.admin.export:main",
            "deepinit-export-admin-lm = fairseq_deepinit.lm.export:main",
        ]
    },
)
