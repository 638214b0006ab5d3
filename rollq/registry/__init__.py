"""Versioned weight registry: versions in Redis (versions.py), the safetensors weight store
(store.py, safetensors_check.py), publishing's last step (commit.py) and retention."""
