"""Integrations with training frameworks (optional extras)."""
