"""Who sends each weights update to whom (the relay transport): the publisher's side of the fan-out tree.

    tree = FanoutTree(fanout=2, relay_fanout=1, share_host_copy=True)
    attached = tree.attach(version, generator_id, relay_address, host_id)       # for each WeightsRequest
    attached.parent      # "" = the publisher, "host:<id>" = that generator's copy on this host, else a relay address
    tree.direct(version, generator_id)                                            # may it pull from the publisher?

Rules, per version (every version has a tree of its own, built as generators ask for it):
  * At most `fanout` generators (k) pull a version from the publisher. Every other one gets a parent among the
    generators attached to that version (they hold it or are receiving it), each taking at most `relay_fanout`
    children: the shallowest such parent (then the one with fewest children, then the earliest), so the chains or
    trees grow evenly. With relay_fanout = 1 the fleet forms k pipelined chains: every uplink carries an update once
    (a ring broadcast's bandwidth), and the latency grows by one chunk's transfer per hop.
  * With `share_host_copy`, only the first generator of a host attaches to the tree; the others read its copy
    ("host:<its generator id>"), so a host costs one transfer whatever its number of generators.
  * A parent reported failed (stalled, a bad chunk, or no copy) leaves that version's tree, and so does its role as
    its host's receiver; it is never offered again for that version. A generator is never given a parent inside its
    own subtree (that would be a cycle that never receives).
  * When no attached generator can take a child (none relays), the publisher takes it beyond k: counted
    `over_fanout`, the only way its bytes can exceed k x the update.
  * Lying peers (a peer is the IP address a request came from: all generators share one role key): each peer has
    at most `max_members_per_peer` generators in a version's tree (more are refused: `MembershipRefused`) and at
    most `max_relays_per_peer` of them offered as parents (the others attach as leaves: `leaves_over_quota`); a
    generator that reported `max_failures` parents failed for a version pulls it from the publisher
    (`direct_after_failures`). So a flood of fake members that never serve costs an honest fetch at most
    `max_failures` stall timeouts, and the publisher's work per attach stays bounded by the peers it serves.
Only the newest `keep_versions` trees are kept (a child still receiving an older version re-attaches to the newest).
A generator that reports a healthy parent as failed only reshapes the tree (and can push it to `over_fanout`); it
cannot make another generator load wrong bytes, since every chunk is checked against the publisher's digests.

Counters (`counters`): attached, reattached/<failure>, bad_relays, over_fanout, leaves_over_quota,
direct_after_failures, refused_members.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

HOST_PREFIX = "host:"  # parent = a generator's copy on this host
FAILURES = ("stalled", "bad_chunk", "unavailable")
MAX_MEMBERS_PER_PEER = 64  # generators of one peer (IP address) in a version's tree
MAX_RELAYS_PER_PEER = 8  # of them, offered as parents (a host relays once with share_host_copy)
MAX_FAILURES = 2  # parents a generator may report failed for one version before it pulls from the publisher


class MembershipRefused(ValueError):
    """A peer already has `max_members_per_peer` generators in this version's tree."""


@dataclass(frozen=True)
class Attachment:
    """Where a generator gets a version from, and how many hops from the publisher that is."""

    parent: str
    depth: int


@dataclass
class _Node:
    generator_id: int
    address: str  # its relay server ("" = it cannot relay)
    parent: str
    order: int  # when it first attached (ties)
    peer: str = ""  # the IP address its requests come from


@dataclass
class _Tree:
    nodes: dict[int, _Node] = field(default_factory=dict)
    hosts: dict[str, int] = field(default_factory=dict)  # host id -> the generator that receives for it
    failed: set[str] = field(default_factory=set)  # parents reported failed (their addresses)
    failures: Counter[int] = field(default_factory=Counter)  # generator id -> parents it reported failed


class FanoutTree:
    """The fan-out trees of the newest versions (see the module docstring). One thread (the publisher's)."""

    def __init__(
        self,
        fanout: int,
        relay_fanout: int,
        share_host_copy: bool = True,
        keep_versions: int = 2,
        max_members_per_peer: int = MAX_MEMBERS_PER_PEER,
        max_relays_per_peer: int = MAX_RELAYS_PER_PEER,
        max_failures: int = MAX_FAILURES,
    ) -> None:
        if min(fanout, relay_fanout, keep_versions, max_members_per_peer, max_relays_per_peer, max_failures) < 1:
            raise ValueError(
                f"fanout, relay_fanout, keep_versions and the per-peer limits must be >= 1 (got {fanout}, {relay_fanout})"
            )
        self.fanout, self.relay_fanout, self.share_host_copy = fanout, relay_fanout, share_host_copy
        self.keep_versions = keep_versions
        self.max_members_per_peer, self.max_relays_per_peer = max_members_per_peer, max_relays_per_peer
        self.max_failures = max_failures
        self.counters: Counter[str] = Counter()
        self._trees: dict[int, _Tree] = {}
        self._order = 0

    def attach(
        self,
        version: int,
        generator_id: int,
        relay_address: str = "",
        host_id: str = "",
        failed_parent: str | None = None,
        failure: str = "",
        peer: str = "",
    ) -> Attachment:
        """The parent `generator_id` pulls `version` from. `failed_parent` (not None): the parent it had for this
        version failed (`failure`: one of FAILURES); it leaves the tree first. `peer`: the IP address the request
        came from. Raises `MembershipRefused` when `peer` has its quota of generators in this tree."""
        tree = self._tree(version)
        members = [n for gid, n in tree.nodes.items() if n.peer == peer and gid != generator_id]
        if generator_id not in tree.nodes and len(members) >= self.max_members_per_peer:
            self.counters["refused_members"] += 1
            raise MembershipRefused(
                f"peer {peer or '?'} has {len(members)} generators in v{version}'s tree already, the most one peer "
                f"may have ({self.max_members_per_peer})"
            )
        if relay_address and sum(1 for n in members if n.address) >= self.max_relays_per_peer:
            self.counters["leaves_over_quota"] += 1
            relay_address = ""  # it receives, but is nobody's parent
        if failed_parent is not None:
            tree.failures[generator_id] += 1
            self._fail(tree, failed_parent, failure)
        if self.share_host_copy and host_id:
            receiver = tree.hosts.get(host_id)
            if receiver is not None and receiver != generator_id and receiver in tree.nodes:
                tree.nodes.pop(generator_id, None)  # a reader relays nothing: its children, if any, re-attach
                return Attachment(f"{HOST_PREFIX}{receiver}", self._depths(tree)[receiver])
            tree.hosts[host_id] = generator_id
        parent = self._choose_parent(tree, generator_id, relay_address)
        node = tree.nodes.get(generator_id)
        if node is None:
            self._order += 1
            tree.nodes[generator_id] = node = _Node(generator_id, relay_address, parent, self._order, peer)
            self.counters["attached"] += 1
        node.address, node.parent = relay_address, parent
        return Attachment(parent, self._depths(tree)[generator_id])

    def direct(self, version: int, generator_id: int) -> bool:
        """True when `generator_id` was told to pull `version` from the publisher itself."""
        node = self._trees.get(version, _Tree()).nodes.get(generator_id)
        return node is not None and node.parent == ""

    def publisher_children(self, version: int) -> int:
        return sum(1 for node in self._trees.get(version, _Tree()).nodes.values() if node.parent == "")

    def parents(self, version: int) -> dict[int, str]:
        """Each attached generator's parent address ("" = the publisher)."""
        return {gid: node.parent for gid, node in self._trees.get(version, _Tree()).nodes.items()}

    def depths(self, version: int) -> dict[int, int]:
        """Each attached generator's hops from the publisher (host-copy readers are not in the tree)."""
        tree = self._trees.get(version, _Tree())
        return self._depths(tree)

    # ------------------------------------------------------------------------------------------------ internals
    def _tree(self, version: int) -> _Tree:
        if version not in self._trees:
            self._trees[version] = _Tree()
            for old in sorted(self._trees)[: -self.keep_versions]:
                del self._trees[old]
        return self._trees.setdefault(version, _Tree())  # an old version asked again: a tree of its own

    def _fail(self, tree: _Tree, parent: str, failure: str) -> None:
        self.counters[f"reattached/{failure if failure in FAILURES else 'other'}"] += 1
        if failure == "bad_chunk":
            self.counters["bad_relays"] += 1
        if parent == "":
            return  # the publisher itself was slow: nothing to take out of the tree
        tree.failed.add(parent)
        if parent.startswith(HOST_PREFIX):
            gone = int(parent.removeprefix(HOST_PREFIX)) if parent.removeprefix(HOST_PREFIX).isdigit() else None
        else:
            gone = next((g for g, n in tree.nodes.items() if n.address == parent), None)
        if gone is not None:
            tree.nodes.pop(gone, None)
            for host in [h for h, receiver in tree.hosts.items() if receiver == gone]:
                del tree.hosts[host]

    def _choose_parent(self, tree: _Tree, generator_id: int, relay_address: str) -> str:
        others = [node for gid, node in tree.nodes.items() if gid != generator_id]
        if sum(1 for node in others if node.parent == "") < self.fanout:
            return ""
        if tree.failures[generator_id] >= self.max_failures:  # beyond k too: counted as over_fanout as well
            self.counters["direct_after_failures"] += 1
            self.counters["over_fanout"] += 1
            return ""
        banned = self._subtree(tree, generator_id, relay_address)
        children = Counter(node.parent for node in others)
        depths = self._depths(tree)
        candidates = [
            node
            for node in others
            if node.address
            and node.address not in tree.failed
            and node.generator_id not in banned
            and children[node.address] < self.relay_fanout
            and depths[node.generator_id] < len(tree.nodes) + 1  # attached to the publisher, not orphaned
        ]
        if not candidates:
            self.counters["over_fanout"] += 1
            return ""
        best = min(candidates, key=lambda n: (depths[n.generator_id], children[n.address], n.order))
        return best.address

    def _subtree(self, tree: _Tree, generator_id: int, relay_address: str) -> set[int]:
        """`generator_id` and every generator below it (found by its address: after it left the tree as a failed
        parent, its old children still name it)."""
        below: dict[str, list[_Node]] = {}
        for node in tree.nodes.values():
            below.setdefault(node.parent, []).append(node)
        members, frontier = {generator_id}, [relay_address] if relay_address else []
        while frontier:
            for child in below.get(frontier.pop(), []):
                if child.generator_id not in members:
                    members.add(child.generator_id)
                    if child.address:
                        frontier.append(child.address)
        return members

    def _depths(self, tree: _Tree) -> dict[int, int]:
        """Every attached generator's hops from the publisher, in one pass over the tree (each chain is walked
        once); len(nodes) + 1 for a generator whose chain is broken (a parent left the tree)."""
        by_address = {n.address: n for n in tree.nodes.values() if n.address}
        limit = len(tree.nodes) + 1
        depths: dict[int, int] = {}
        for node in tree.nodes.values():
            chain, current, base = [], node, -1
            while base < 0:
                if current.generator_id in depths:
                    base = depths[current.generator_id]
                    break
                chain.append(current)
                above = by_address.get(current.parent)
                if current.parent == "":
                    base = 0
                elif above is None or len(chain) >= limit:  # broken (a cycle cannot form, see _subtree)
                    base = limit
                else:
                    current = above
            for hops, member in enumerate(reversed(chain), start=1):
                depths[member.generator_id] = limit if base >= limit else min(limit, base + hops)
        return depths
