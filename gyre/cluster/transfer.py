"""Arrays between processes with JAX's own transfer service (``jax.experimental.transfer``).

A :class:`TransferPoint` is one process's server. The sender *offers* a pytree under a ticket
(its server's address and a fresh uuid); the receiver *pulls* it by the ticket into shardings
with the same partition specs on its own mesh. Pulling into another layout fails inside the
service, so a move is always: reshard locally into the target role's specs, offer, pull
(:func:`gyre.mesh.move` stays the in-process path). All cells share one mesh shape, so the
receiver's layout always exists on the sender.

A pull whose deadline passed may still block (measured: it fails only when the sender exits),
so the deadline is the caller's: the driver waits on every pull with
``cluster.transfer_timeout_s`` and declares the sender's cell lost past it
(gyre/cluster/remote.py), which ends the sender and with it the blocked pull.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import time

import jax
from jax.sharding import NamedSharding


@dataclasses.dataclass(frozen=True)
class Ticket:
    """Where an offered pytree waits: the sender's server address and the offer's uuid."""

    address: str
    uuid: int


def retarget(shardings, mesh):
    """The same partition specs on ``mesh`` (a pytree of NamedSharding)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s.spec), shardings)


def abstract(shardings, like):
    """ShapeDtypeStructs of ``like`` (arrays or structs) with ``shardings``: what a pull needs."""
    return jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shardings, like)  # fmt: skip


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


class TransferPoint:
    """This process's transfer server, its connections, and counts of what moved.

    host: the address peers reach this process at (Ray's node address on a cluster).
    """

    def __init__(self, host: str = "127.0.0.1"):
        from jax.experimental import transfer

        client = jax.devices()[0].client
        self.server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        self.address = self.server.address()
        self._conns: dict[str, object] = {}
        # uuids unique across processes: this process's id in the high bits
        self._uuids = itertools.count((os.getpid() & 0xFFFFF) << 40)
        self.stats = collections.Counter()  # offers, pulls, pulled_bytes, pull_s

    def offer(self, tree) -> Ticket:
        """Holds ``tree`` until one peer pulls it -> the ticket to pull it by."""
        uuid = next(self._uuids)
        self.server.await_pull(uuid, tree)
        self.stats["offers"] += 1
        return Ticket(self.address, uuid)

    def pull(self, ticket: Ticket, target):
        """The pytree offered under ``ticket``, into ``target`` (ShapeDtypeStructs with
        shardings on this process's devices, the sender's partition specs)."""
        conn = self._conns.get(ticket.address)
        if conn is None:
            conn = self._conns[ticket.address] = self.server.connect(ticket.address)
        t0 = time.perf_counter()
        tree = jax.block_until_ready(conn.pull(ticket.uuid, target))
        self.stats["pulls"] += 1
        self.stats["pulled_bytes"] += nbytes(target)
        self.stats["pull_s"] += time.perf_counter() - t0
        return tree
