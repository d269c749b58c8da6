"""Errors raised before heavy work starts. Each message names the problem and the fix."""


class UpdateLensError(Exception):
    """Base class of every error the package raises on purpose."""


class ConfigError(UpdateLensError, ValueError):
    """An analysis setting is out of range or unknown."""


class RegistryError(UpdateLensError, KeyError):
    """A model or corpus is not in the registry, or its source cannot be reached."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ModelError(UpdateLensError, RuntimeError):
    """A model cannot be loaded or analysed (missing LM head, blocks not found, bad weights)."""


class CorpusError(UpdateLensError, ValueError):
    """A corpus is empty, binary, or too short for the requested sample."""
