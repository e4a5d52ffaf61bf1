"""Redis Cluster support: connecting by URL with detection, routing FCALL without a
lookup, and talking to the one server that holds a tag.

``connect(url)`` asks the server at ``url`` whether it is a cluster node (``INFO cluster``)
and returns a ``redis.cluster.RedisCluster`` if so, a plain ``redis.Redis`` otherwise; the
engine works with either. Every function call of the engine names its keys in KEYS, all
under one hash tag, so it runs on the one primary that owns the tag's slot.

redis-py finds the slot of most commands from their arguments, but FCALL is a command with
"movable keys", for which it asks the server (``COMMAND GETKEYS``) on every call: a second
round trip per engine call. ``fcall_routing`` makes a cluster client read FCALL's keys from
its ``numkeys`` argument, as redis-py already does for EVAL.

A tag's state is trustworthy only as long as the same server process, with the same
replication history, has applied every write to it: a replica promoted after a failover
(replication is asynchronous) or a server restarted from an older snapshot may lack the
last acknowledged writes while still looking complete. ``server_identity`` names that
history (run id and replication id), and the engine stamps a tag with it when the tag is
marked ready (``Engine.init_tag``); a stamp that differs from the identity of the server
now holding the tag means the state may have lost writes (``Engine.tags_health``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import redis
from redis._parsers import CommandsParser  # what RedisCluster.commands_parser is
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

#: A client the engine can use: one server, or a Redis Cluster.
Client = redis.Redis | RedisCluster

_FCALL = frozenset({"FCALL", "FCALL_RO"})

#: How a cluster client retries a call that met a dead node or a slot without a primary:
#: every retry first asks the cluster for its slot map again, and backing off 0.1, 0.2, 0.4,
#: 0.8, 1, 1 s rides through a failover of up to about 3.5 s (a node timeout of 1-2 s plus
#: the replica's election) before giving up. redis-py's default backs off up to 10 s.
CLUSTER_RETRY = Retry(ExponentialBackoff(cap=1.0, base=0.1), retries=6)


class _FcallKeys(CommandsParser):
    """redis-py's command parser, but FCALL's keys are read from its arguments
    (``FCALL name numkeys key...``) instead of asked of the server."""

    def __init__(self, inner: CommandsParser) -> None:
        # Take over the parser's command table rather than ask the server for it again.
        self.__dict__.update(inner.__dict__)

    def get_keys(self, redis_conn: Any, *args: Any) -> Any:
        if len(args) > 2 and str(args[0]).upper() in _FCALL:
            return list(args[3 : 3 + int(args[2])])
        return super().get_keys(redis_conn, *args)  # type: ignore[no-untyped-call]


def fcall_routing(client: RedisCluster) -> RedisCluster:
    """Route FCALL by its KEYS without a ``COMMAND GETKEYS`` round trip (idempotent).
    Pipelines made from the client share its parser, so they route the same way."""
    if not isinstance(client.commands_parser, _FcallKeys):
        client.commands_parser = _FcallKeys(client.commands_parser)
    return client


def is_cluster_node(client: redis.Redis) -> bool:
    """True if the server runs in cluster mode (``cluster_enabled:1``)."""
    return bool(int(client.info("cluster").get("cluster_enabled", 0)))


def connect(url: str, **kwargs: Any) -> Client:
    """A client for ``url``: a cluster client if the server there is a cluster node
    (detected, no setting needed), else a plain one. ``kwargs`` go to the client."""
    probe = redis.Redis.from_url(url, **kwargs)
    try:
        cluster = is_cluster_node(probe)
    finally:
        probe.close()
    if not cluster:
        return redis.Redis.from_url(url, **kwargs)
    return fcall_routing(RedisCluster.from_url(url, retry=CLUSTER_RETRY, **kwargs))


def server_identity(info: dict[str, Any]) -> str:
    """Who holds a copy of the data, from ``INFO server replication``: the process (run id,
    new at every restart) and its replication history (replication id, new whenever the
    server is promoted to primary). Two writes stamped with the same identity were
    applied by one server without a break in between."""
    return f"{info['run_id']}:{info['master_replid']}"


def node_clients(client: Client, keys: Iterable[str]) -> dict[Any, list[str]]:
    """Group keys by the server that holds them; each group's client talks to that server
    only (on a plain client, the client itself). A cluster client's slot map may be stale
    right after a failover: the server then answers MOVED, and the caller learns nothing
    about those keys this time."""
    groups: dict[Any, list[str]] = defaultdict(list)
    if not isinstance(client, RedisCluster):
        groups[client] = list(keys)
        return groups
    cluster: Any = client  # redis-py leaves these methods untyped
    by_node: dict[str, Any] = {}
    for key in keys:
        node = cluster.get_node_from_key(key)
        conn = by_node.setdefault(node.name, node.redis_connection)
        groups[conn].append(key)
    return groups


def primary_clients(client: Any) -> list[Any]:
    """A client per primary of a cluster (or the client itself): for commands about a
    server rather than a key, such as the Functions libraries it has loaded."""
    if isinstance(client, RedisCluster):
        cluster: Any = client  # redis-py leaves get_primaries untyped
        return [node.redis_connection for node in cluster.get_primaries()]
    return [client]


def node_client(client: Client, key: str) -> Any:
    """A client of the one server that holds ``key`` (see ``node_clients``)."""
    return next(iter(node_clients(client, [key])))
