"""Integrations with frameworks (each an optional extra): :mod:`.django`."""
