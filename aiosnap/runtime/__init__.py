"""What a checkpointer runs beside its engine: the live display and the preemption hook."""
