"""Errors that carry a message for an operator: the CLI prints them as one line, no traceback."""

from __future__ import annotations


class HotweightsError(Exception):
    """Base of every error whose message names the problem and the fix."""


class CheckpointError(HotweightsError):
    """The checkpoint on disk is missing, corrupt, refused or does not match its config."""


class ConfigError(HotweightsError):
    """A command-line or configuration value is out of range or inconsistent."""


class BindingError(HotweightsError):
    """Processed tensors do not fit the model built on ``meta`` (missing, extra, wrong shape or dtype)."""
