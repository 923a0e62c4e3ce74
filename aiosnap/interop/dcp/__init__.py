"""DCP (``torch.distributed.checkpoint``) checkpoints: written and read through aiosnap
(:mod:`.writer`, :mod:`.reader`), and seen as read-only aiosnap roots (:mod:`.translate`).
The public names are in :mod:`aiosnap.dcp`."""
