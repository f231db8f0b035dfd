"""Errors every layer may raise. Kept at the bottom of the import graph so that no module has to import upward to
say "this input is wrong"."""

from __future__ import annotations

from kvq_lab.quant.spec import QuantConfigError


class ConfigError(QuantConfigError):
    """A run setting or input is invalid. Raised before any model load; run.py prints it as one line, exits 2."""
