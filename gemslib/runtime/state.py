"""State the runtime's modules share: the call being planned on this thread, the forced()
and recording blocks open, and the workload being recorded."""

from __future__ import annotations

import threading


class _PlanningState(threading.local):
    """The call being planned on this thread: its launches (None entries: unplannable) and the
    outputs it zeroed. Class defaults, so that reading them where nothing is being planned
    (every call) is an attribute lookup, not a caught AttributeError."""
    launches: list | None = None
    zeroed: set | None = None


planning = _PlanningState()
forcing = 0  # forced() and recording blocks open: configs are being swept, no plan applies
workload = None  # the recording.Workload being recorded, if any


def not_plannable() -> None:
    """Marks the call being planned, if any, as one no plan can replay (it launched outside
    the kept launches)."""
    launches = planning.launches
    if launches is not None:
        launches.append(None)
