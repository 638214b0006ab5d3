"""Adapters that let other training libraries use a rollq pool (each an optional extra)."""
