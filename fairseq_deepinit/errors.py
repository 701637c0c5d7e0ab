"""The plugin's error types, in one place so that every layer of the package can raise them.

:class:`DeepInitConfigError` is an invalid or incompatible combination of options, found before a
model is built (or when a checkpoint's stored options are validated again);
:class:`CheckpointFileError` a checkpoint that cannot be read, and :class:`ConfigChangeError` a
resumed run whose model options differ from its checkpoint's.
"""

from __future__ import annotations


class DeepInitConfigError(ValueError):
    """An invalid or incompatible combination of deepinit options."""


class CheckpointFileError(SystemExit):
    """A checkpoint file that cannot be read, or a resume that must not go on.

    A :class:`SystemExit` whose code is the message: an uncaught one ends fairseq-train,
    fairseq-generate or a plugin tool with that single line on stderr and exit status 1, no
    traceback (and fairseq's ``except Exception`` crash handlers let it through).
    """

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")
        self.message = message


class ConfigChangeError(CheckpointFileError):
    """A resumed ``deepinit`` run whose model options differ from its checkpoint's."""
