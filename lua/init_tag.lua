-- init_tag.lua: mark a tag ready: its state is complete (fresh, or rebuilt by the caller
-- after a loss of Redis data). Admits and set_limits with require_ready store nothing on a
-- tag not ready (see docs/engine.md, Readiness).
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: none
-- Does: set the READY field of `state` if missing (idempotent).
-- Returns: 1 if this call marked the tag ready, 0 if it already was.
return call('HSETNX', K_STATE, READY, 1)
