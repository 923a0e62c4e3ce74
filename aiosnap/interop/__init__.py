"""Checkpoint formats over storage besides aiosnap's own folders: a root that is one
``torch.load``-readable file (:mod:`.singlefile`). They reuse the planner, the loader and
the storage backends."""
