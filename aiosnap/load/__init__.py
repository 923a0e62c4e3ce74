"""Reading a checkpoint back: byte ranges into tensors (:mod:`.fetch`), values into a live
state (:mod:`.apply`)."""
