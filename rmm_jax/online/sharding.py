"""Spread the users axis over devices with ``jax.sharding``.

A 1-D :class:`~jax.sharding.Mesh` named ``users`` over every device (of every host after
``jax.distributed.initialize``) and a :class:`~jax.sharding.NamedSharding` that splits
the leading (users) dimension of every array. In scope ``user`` the online loop is
per-user independent, so XLA runs each device's users with no communication; results
equal the single-device run for the same seed. In scopes ``shared``/``hybrid`` the shared
part is replicated (:func:`replicate`) and the sum of the users' gradients that updates it
becomes an all-reduce that XLA inserts (over gloo or the accelerator's interconnect
across processes); results equal the single-device run up to float32 summation order.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def users_mesh(devices=None) -> Mesh:
    """A 1-D mesh named ``users`` over ``devices`` (default: all devices, all hosts)."""
    devices = jax.devices() if devices is None else devices
    return Mesh(np.asarray(devices), ("users",))


def shard_users(tree, mesh: Mesh):
    """Place every leaf with its leading axis split over the mesh's ``users`` axis.

    The leading axis must be divisible by the number of devices (choose the users chunk
    as a multiple of it).
    """
    n = mesh.devices.size

    def put(x):
        if x.shape[0] % n:
            raise ValueError(f"users_per_chunk: {x.shape[0]} users do not split over {n} devices")
        return jax.device_put(x, NamedSharding(mesh, P("users")))

    return jax.tree.map(put, tree)


def replicate(tree, mesh: Mesh):
    """Place every leaf whole on every device of the mesh (the shared part of a policy)."""
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), tree)
