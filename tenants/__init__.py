"""Policy: tenants, sub-tenants, shards, latency classes, pool settings; sync to Redis."""
