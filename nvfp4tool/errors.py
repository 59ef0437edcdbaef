"""The one exception type for problems a user can cause (bad file, bad tensor, bad option).

The message must name the file and/or tensor and the problem in one line; the CLI prints it as
`Error: <message>` and exits 1 (failed check / bad input). Usage mistakes are click's own
`UsageError` (exit 2).
"""


class NVFP4ToolError(Exception):
    """A user-facing error: one line naming file, tensor and problem."""


class NVFP4UsageError(NVFP4ToolError):
    """The options or configuration cannot describe a valid job (the CLI exits 2, as for bad usage)."""
