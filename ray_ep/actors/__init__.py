"""Ray actors of ray_ep: one worker per rank, and the group that places and drives them."""

from ray_ep.actors.group import EPWorkerGroup, WorkerContext

__all__ = ["EPWorkerGroup", "WorkerContext"]
