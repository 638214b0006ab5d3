"""Versioned weight registry (versions in Redis, safetensors weight store): not built yet."""
