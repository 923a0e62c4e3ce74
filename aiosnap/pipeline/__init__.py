"""The background stages of a save: capture -> upload -> commit, joined by bounded queues."""
