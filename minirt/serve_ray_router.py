"""The Ray Serve request router of :mod:`minirt.serve_ray` (its own module: Ray imports it by
path in every process that routes requests, and importing it needs Ray)."""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import RequestRouter

from .serve_ray import rank_replicas


class PrefixAffinityRouter(RequestRouter):
    """Ranks the replica a request's routing key hashes to (rendezvous hashing) first and the
    others after it, so Ray Serve falls back to them only when that one is saturated. Requests
    without a key (the first argument, "" when none) go to Ray Serve's usual choice among all."""

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        key = ""
        if pending_request is not None and pending_request.args:
            a0 = pending_request.args[0]
            key = a0 if isinstance(a0, str) else ""
        if not key or len(candidate_replicas) < 2:
            return [candidate_replicas]
        order = rank_replicas(key, [str(r.replica_id.unique_id) for r in candidate_replicas])
        return [[candidate_replicas[order[0]]], [candidate_replicas[i] for i in order[1:]]]
