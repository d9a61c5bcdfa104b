"""Exceptions of ray_ep.

Every error derives from :class:`EPError`, carries only a message, and therefore survives
pickling through Ray unchanged. Messages say what was wrong and what to change.
"""

from __future__ import annotations


class EPError(Exception):
    """Base class of every ray_ep error."""


class EPInputError(EPError, ValueError):
    """A tensor handed to a phase has the wrong shape, dtype, device or values."""


class EPStateError(EPError, RuntimeError):
    """A phase was called at the wrong time (before start, after shutdown, out of order)."""


class EPConfigError(EPError, ValueError):
    """The config does not fit the process group (world size, devices, backend) or differs
    between its ranks."""


class EPClusterError(EPError, RuntimeError):
    """The Ray cluster cannot host the requested topology (nodes, GPUs or CPU slots)."""


class EPWorkerError(EPError, RuntimeError):
    """A worker died or failed; the group must be rebuilt."""


class EPTimeoutError(EPError, TimeoutError):
    """A rank waited for peers that never signalled, or a group call ran past its limit."""


class EPOverflowError(EPError, RuntimeError):
    """More rows arrived for a rank or expert than its buffer holds."""
