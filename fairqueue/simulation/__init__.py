"""The what-if simulation: FairQueue's scheduling replayed in memory, event by event.

`engine_model` is the engine's admission, fair order and handoff as plain Python (heaps,
no Redis); `scheduler` drives it with arrivals, worker slots, a broker and the periodic
limit refresh computed by the very functions the fleet runs (`fairqueue.jobs.limits_plan`,
`fairqueue.jobs.admission`). Nothing here reads a database or Redis: callers pass the
arrivals and the policy (`fairqueue.jobs.whatif` loads them from Job rows).
"""
