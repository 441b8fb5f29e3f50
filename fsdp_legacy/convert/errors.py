"""The one error type of checkpoint reading, writing and conversion."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, written or converted; the message names the file or key and the fix."""
