"""The transfer side of a save: upload, checksums, commit, retention, spool resume.

The same code runs on a thread of the training process or in the helper process
(``upload.executor``); it sees staged chunks only as small descriptors.
"""
