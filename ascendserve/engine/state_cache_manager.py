"""State slots for recurrent layers (Gated DeltaNet): one fixed-size slot per running request."""

import heapq


class StateCacheManager:
    """Hands out slots of a preallocated state pool; a request keeps its slot while it runs.

    Invariant: num_free + len(req_to_slot) == num_slots. A chunked prefill continues from the slot
    it wrote last step; finish, abort and preemption give the slot back (a preempted request
    recomputes from token 0 into whichever slot it gets next). The lowest free slot goes first, so
    B running requests tend to hold slots 0..B-1, which the decode kernel updates in place.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a min-heap
        self.req_to_slot: dict[str, int] = {}

    @property
    def num_free_slots(self) -> int:
        """Slots not held by any request."""
        return len(self._free)

    def allocate(self, request_id: str) -> int | None:
        """The slot of `request_id`, taking a free one if it has none; None if all are taken."""
        slot = self.req_to_slot.get(request_id)
        if slot is None and self._free:
            slot = heapq.heappop(self._free)
            self.req_to_slot[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        """Give back the slot of `request_id`, if it holds one."""
        slot = self.req_to_slot.pop(request_id, None)
        if slot is not None:
            heapq.heappush(self._free, slot)

    def get_slot(self, request_id: str) -> int | None:
        """The slot held by `request_id`, or None."""
        return self.req_to_slot.get(request_id)
