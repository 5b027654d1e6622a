"""Error types with messages meant for users: each names the file, field or tensor and what was expected.

The CLI prints these as one line (no traceback) and exits with status 2.
"""


class DFlashError(Exception):
    """Base class of every user-facing dflashkit error."""


class ConfigError(DFlashError):
    """A config file or field is missing, malformed or inconsistent."""


class CheckpointError(DFlashError):
    """A checkpoint directory is missing files or tensors, or its tensors do not fit its config."""


class TargetError(DFlashError):
    """A target model cannot be found, loaded, or does not fit the drafter."""


class DataError(DFlashError):
    """Input data (JSONL, prompts, caches) is malformed."""
