"""Multi-rank checkpoints on torch.distributed: the caller's side.

- :mod:`.job`: a checkpointer's place in the job; what each ``save()``/``load()`` agrees on.
- :mod:`.group`: aiosnap's own CPU (gloo) group; agreement on the caller's thread (never on
  aiosnap's loop thread, never on the trainer's group).
- :mod:`.assign`: which rank writes each replicated entry (pure).
- :mod:`.stateful`: model and optimizer state of sharded models through torch's own
  ``get_state_dict``/``set_state_dict``.

The rest lives with the layer it belongs to: a DTensor's shard on the save side
(:mod:`aiosnap.trainer.dtensor`), a rank's part and the coordinator's merge
(:mod:`aiosnap.format.parts`), shard tiling (:mod:`aiosnap.format.tiling`), the commit through
storage (:mod:`aiosnap.transfer.rank_commit`), resharding reads (:mod:`aiosnap.load.reshard`)
and a rank's view of a checkpoint (:mod:`aiosnap.load.ranks`).
"""
