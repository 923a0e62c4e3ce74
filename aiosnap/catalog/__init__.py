"""The catalog of a root: steps and retention (:mod:`.steps`), listing, verifying and
copying (:mod:`.maintenance`), garbage collection (:mod:`.garbage`). Reads storage, owns no
bytes."""
