"""The ways a run stops on purpose (both light to import: ``train.py --help`` loads no torch)."""


class ConfigError(ValueError):
    """A user mistake in the options, the recipe files or the paths they name (exit code 2)."""


class NonFiniteLossError(RuntimeError):
    """Training diverged; the run stops before saving, so the last checkpoint is the last good one (exit 1)."""


class Interrupted(Exception):
    """Ctrl-C: the message says what was kept (exit code 130, as a shell reports SIGINT)."""


class UnreadableImageError(ConfigError):
    """An image file that PIL cannot decode, raised when unreadable images are not skipped (exit code 2).

    Raised in a DataLoader worker, it comes back with the worker's traceback as its message: only the
    original one-line message is kept."""

    def __init__(self, message: str):
        if "Traceback" in message:
            message = message.strip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(message)
