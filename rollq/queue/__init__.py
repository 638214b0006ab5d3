"""Redis Streams queue: work streams per trainer, leases, results, all through Lua scripts."""
