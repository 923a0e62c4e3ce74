"""The trainer side of a save: what must touch the caller's tensors.

Planning (flatten the state, lay out chunks: :mod:`.plan`), the capture copy into staging
slabs (:mod:`.capture`, :mod:`.tensorio`) and the local-disk spool (:mod:`.spool`). In
``upload.executor: process`` mode this is all that runs in the training process.
"""
