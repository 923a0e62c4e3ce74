"""Test helpers shipped with aiosnap (used by its own suite and benchmark; handy in yours).

- :func:`~aiosnap.testing.s3server.moto_server`: a real S3 protocol server (moto, needs
  ``moto[server]``) in a child process on 127.0.0.1;
- :class:`~aiosnap.testing.faultproxy.FaultProxy`: a TCP proxy that resets connections
  mid-body, caps bandwidth or answers 503 SlowDown.
"""
