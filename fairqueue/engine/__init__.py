"""The throttle engine: keys, limits, priorities and leases in Redis Lua. No Django here."""
