"""Redis key names for mirrored policy; the jobs side reads exactly these.

All under one Redis Cluster hash tag, `{policy}`: a policy write is one MULTI/EXEC that
WATCHes the version counter, and a read loads every hash in one MULTI, which a cluster
only allows within one slot. Policy is small and read through a per-process cache (one
GET of the version every 0.25 s), so one node holding it all costs nothing.
"""

from __future__ import annotations

PREFIX = "fq:{policy}:"
VERSION_KEY = "fq:{policy}:version"  # INCRed with every change: the cheap "last changed" marker
SYNCED_KEY = "fq:{policy}:synced"  # written by a full sync; its absence means Redis lost its data
RESYNC_LOCK_KEY = "fq:{policy}:resync_lock"  # SET NX so one process resyncs after a loss
# INCRed when an API key is rotated (which changes no policy): read with the policy version,
# so every process drops its cached keys within one policy check (tenants.authentication).
AUTH_VERSION_KEY = "fq:{policy}:auth_version"
POOL_KEY = "fq:{policy}:pool"
TENANTS_INDEX = "fq:{policy}:tenants"
SHARDS_INDEX = "fq:{policy}:shards"
CLASSES_INDEX = "fq:{policy}:classes"
RESOURCES_INDEX = "fq:{policy}:resources"

# Keys a full resync must not delete: the counter stays monotonic, the lock guards the resync.
PRESERVED_KEYS = frozenset({VERSION_KEY, RESYNC_LOCK_KEY})


def tenant_key(slug: str) -> str:
    return f"{PREFIX}tenant:{slug}"


def subtenants_key(slug: str) -> str:
    return f"{PREFIX}subtenants:{slug}"


def shard_key(name: str) -> str:
    return f"{PREFIX}shard:{name}"


def class_key(name: str) -> str:
    return f"{PREFIX}class:{name}"


def resource_key(name: str) -> str:
    return f"{PREFIX}resource:{name}"


# The latest policy changes, for markers on the dashboard's charts (tenants.change_markers):
# a sorted set by time. Outside `{policy}`, so a full resync of policy keeps it.
CHANGE_MARKERS_KEY = "fq:policy_changes"
