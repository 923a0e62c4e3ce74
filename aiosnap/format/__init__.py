"""What a checkpoint is on storage: the manifest (:mod:`.manifest`), the state's tree
(:mod:`.tree`) and the spool journal (:mod:`.journal`). Pure code; untrusted input is
validated here."""
