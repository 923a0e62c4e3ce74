"""Hugging Face safetensors: export aiosnap checkpoints as sharded safetensors folders and
read safetensors folders back, locally or on S3, with no local staging.

Importing this package imports nothing heavy: the upload process (which has no torch) uses
:mod:`.header`, :mod:`.layout` and :mod:`.writer`."""
