"""Multi-rank checkpoints on torch.distributed.

- :mod:`.group`: aiosnap's own CPU (gloo) group and what ranks agree on inside ``save()`` and
  ``load()``, on the caller's thread (never on the loop thread, never on the trainer's group).
- :mod:`.shards`: a DTensor's local shard and its box in the global tensor (save side).
- :mod:`.assign`: which rank writes each replicated entry (pure).
- :mod:`.parts`: a rank's part of a save (the per-rank manifest) and the coordinator's merge (pure).
- :mod:`.commit`: the storage-based commit of a multi-rank save (loop thread).
- :mod:`.restore`: the view of a multi-rank manifest one rank loads, and resharding reads.
"""
