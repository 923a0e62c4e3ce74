"""The engine's parts (composed by :class:`aiosnap.service.Engine`): staging resources,
admission, the link to the transfer side, one job per save, and what a checkpointer runs
beside its engine (the live display and the preemption hook)."""
