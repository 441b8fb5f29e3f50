"""The error types of checkpoint reading, writing and conversion."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, written or converted; the message names the file or key and the fix."""


class DestinationMissing(CheckpointError, FileNotFoundError):
    """The directory a checkpoint is to be written into does not exist (a FileNotFoundError too, as torch.save's)."""


class DestinationKind(CheckpointError, FileExistsError):
    """The destination exists as a file where a directory is written, or the reverse."""
