"""The two ways a run stops on purpose (both light to import: ``train.py --help`` loads no torch)."""


class ConfigError(ValueError):
    """A user mistake in the options, the recipe files or the paths they name (exit code 2)."""


class NonFiniteLossError(RuntimeError):
    """Training diverged; the run stops before saving, so the last checkpoint is the last good one (exit 1)."""
