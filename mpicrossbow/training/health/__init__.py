"""A job's health: heartbeats and the watchdog, dead peers and dead links, the signal stop, preemption and
requeue, and the fault drills that test them."""
