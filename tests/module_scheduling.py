"""The suite's pytest-xdist scheduler: one module per unit of work (the shared server's modules
one unit), and a run that survives a worker that dies.

pytest-xdist 3.8's ``LoadScopeScheduling`` deadlocks after a worker dies (pytest-xdist issues
1323, 1327 and 1378, unreleased fixes): it puts every unit the dead worker ever held back on
the queue, finished ones included, and a finished unit goes out as an empty batch that no
worker ever reports on; and it hands the replacement worker a single unit, which a worker
with one test never starts, since it runs a test only once it knows the next one or is told
to stop. Either way the run waits until CI kills it, with no summary and no name for the
test that died. Here only unfinished units go back, the test the worker died in is not run
again (it would take the replacement down too), a worker is never left holding a single
test, and work sent to a worker that died since its last report waits for its replacement
instead of ending the run with an internal error.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController


class ModuleScheduling(LoadScopeScheduling):
    """Modules as work units, the modules in ``shared`` (node-id paths) as one more."""

    def __init__(self, config: object, log: object, shared: set[str], shared_unit: str) -> None:
        super().__init__(config, log)
        self.shared = shared
        self.shared_unit = shared_unit

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return self.shared_unit if module in self.shared else module

    def remove_node(self, node: WorkerController) -> str | None:
        """The test ``node`` died in (None where it had finished): reported failed by
        pytest-xdist, counted as run here; the rest of its unfinished units are queued again."""
        workload = self.assigned_work.pop(node)
        crashed = next(
            (nodeid for unit in workload.values() for nodeid, done in unit.items() if not done),
            None,
        )
        if crashed is None:
            return None
        workload[self._split_scope(crashed)][crashed] = True
        self.workqueue.update(
            (scope, unit) for scope, unit in workload.items() if not all(unit.values())
        )
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _assign_work_unit(self, node: WorkerController) -> None:
        if not self.workqueue:  # the first workers of a run took every unit
            self._stop(node)
            return
        try:
            super()._assign_work_unit(node)
        except OSError:
            # it died since its last report: the unit is on its books, and remove_node, which
            # its death calls next, queues it again
            return
        if self._pending_of(self.assigned_work[node]) < 2:
            # a single test it would never start: give it the next unit, or tell it to stop
            if self.workqueue:
                self._assign_work_unit(node)
            else:
                self._stop(node)

    @staticmethod
    def _stop(node: WorkerController) -> None:
        if not node.shutting_down:
            node.shutdown()
