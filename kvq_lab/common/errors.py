"""Errors every layer may raise. Kept at the bottom of the import graph (no imports of kvq_lab) so that no module
has to import upward to say "this input is wrong"."""

from __future__ import annotations


class QuantConfigError(ValueError):
    """A quantization setting is out of range. The message names the setting, its value and the fix."""


class ConfigError(QuantConfigError):
    """A run setting or input is invalid. Raised before any model load; run.py prints it as one line, exits 2."""
