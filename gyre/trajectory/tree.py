"""Prefix-shared token trees: all calls of one execution as one token trie.

The trie is radix-compressed into *runs*: a run is a chain of nodes created by one call from
one contiguous slice of its prompt or completion, and its node ids are contiguous, so node
``s + i`` of a run starting at ``s`` has parent ``s + i - 1``. A branch at any node is an
explicit child run; runs are never split, so node ids are stable while calls are inserted.

A node is shared only by tokens that one behaviour policy would train identically:

* A **generated** token (completion) joins an existing child with its token id only if that
  child is context, or was generated with the same behaviour: the same version and a logprob
  within ``SAME_LOGP_TOL`` (``isclose``, rtol = atol = 1e-6: a ratio error of ~1e-6 at
  most; the node keeps the first call's value). Otherwise it starts a sibling branch with
  the same token id, so a retry served by other weights never trains with another call's
  logprob or version. Joining a context node makes it trainable with this call's values.
* A **prompt** token joins an existing child with its token id whatever it holds (a context
  node, or a token some call generated after exactly this prefix, which is then trained on
  this call's path too, with its generator's values, as before this rule). Only where
  siblings carry the token (generated under different behaviours) must it choose, and
  identical tokens cannot tell which call it continues, so the records' parent ids do: the
  prompt first follows its *guide*'s path as far as the two agree (the guide is the call's
  parent, the call it continues, else the previous call), and from there the branch where
  it matches furthest (the oldest on ties). A wrong parent id can cost sharing (the prompt
  leaves what it continues for its guide's branch), never a wrong value.

So every trainable node holds the logprob and version of a call that generated exactly that
token after exactly that prefix, and on the path of the call that generated it, its own.

Insertion compares token arrays in place (first mismatch via ``argmax`` of ``!=``, no copies):
each call jumps along its guide's path to the depth where they part (one comparison and a
bisect), then descends the radix children by first token, trying every branch only below
*twins* (nodes with two same-token children). The result holds per-node arrays plus
per-call lists of ``(run, nodes_taken)`` pairs; no Python object is made per token.

Node fields: trainable (generated at that node; ``logp`` and ``version`` of the call that
created or first claimed it), context otherwise (``version = -1``).
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from gyre.trajectory.records import CallRecord

Path = tuple[tuple[int, int], ...]  # ((run, nodes taken from the run's start), ...)
SAME_LOGP_TOL = 1e-6  # rtol and atol of the logprobs of generated tokens sharing a node


@dataclasses.dataclass(frozen=True, eq=False)
class Tree:
    """One execution's token trie. N nodes in insertion order, R runs, C calls.

    tokens/parent/depth/version: int32[N]; trainable: bool[N]; logp: float32[N].
    run_start/run_len: int32[R]. call_paths[c]: the call's root-to-end path as run pairs.
    call_end: int32[C] node id of each call's last token. leaf_calls: int32 indices of the
    calls owning a trie leaf (first call in record order when several end there).
    """

    execution_id: str
    end_reason: str
    tokens: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    trainable: np.ndarray
    logp: np.ndarray
    version: np.ndarray
    run_start: np.ndarray
    run_len: np.ndarray
    call_ids: tuple[int, ...]
    call_roles: tuple[str, ...]
    call_paths: tuple[Path, ...]
    call_end: np.ndarray
    leaf_calls: np.ndarray
    trainable_cum: np.ndarray  # int64[N + 1]: trainable nodes before each node id

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.size)

    def path_nodes(self, call: int) -> np.ndarray:
        """int32[L]: node ids from the root to the end of call index ``call``."""
        parts = [
            np.arange(self.run_start[r], self.run_start[r] + t) for r, t in self.call_paths[call]
        ]
        return np.concatenate(parts).astype(np.int32)

    def path_trainable(self, call: int) -> int:
        """Number of trainable nodes on the root-to-end path of call index ``call``."""
        cum = self.trainable_cum
        return int(
            sum(
                cum[self.run_start[r] + t] - cum[self.run_start[r]]
                for r, t in self.call_paths[call]
            )
        )


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two 1-D arrays (vectorised, no copies)."""
    n = min(a.size, b.size)
    if n == 0:
        return 0
    ne = a[:n] != b[:n]
    i = int(ne.argmax())
    return i if ne[i] else n


def _lcp_seq(pieces: tuple[np.ndarray, ...], k: int, ref: np.ndarray) -> int:
    """Common prefix length of concat(pieces)[k:] and ref, reading the pieces in place."""
    n = 0
    for piece in pieces:
        if k >= piece.size:
            k -= piece.size
            continue
        seg = piece[k:]
        m = _lcp(seg, ref[n:])
        n += m
        if m < seg.size or n == ref.size:
            return n
        k = 0
    return n


def _lcp_calls(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> int:
    n = 0
    for ref in b:
        m = _lcp_seq(a, n, ref)
        n += m
        if m < ref.size:
            break
    return n


class _Builder:
    """Mutable state of one trie while calls are inserted (runs kept as Python lists).

    Per node: ``gen`` (the call that generated it, -1 for context), ``logp``, ``version``;
    arrays grown by doubling. ``twins``: sorted ids of nodes (-1: the root) with two child
    runs starting with the same token, the only places where a prompt must choose.
    """

    def __init__(self, records: list[CallRecord]):
        self.records = records
        self.seqs = [(r.prompt, r.completion) for r in records]
        self.run_start: list[int] = []
        self.run_len: list[int] = []
        self.run_parent: list[int] = []
        self.run_depth: list[int] = []
        self.run_src: list[tuple[int, int, int]] = []  # (call, 0 prompt | 1 completion, offset)
        self.children: dict[int, dict[int, list[int]]] = {}  # node (-1: roots) -> {token: runs}
        self.twins: list[int] = []
        self.paths: list[list[tuple[int, int]]] = []
        self.n_nodes = 0
        self.gen = np.zeros(0, np.int32)
        self.logp = np.zeros(0, np.float32)
        self.version = np.zeros(0, np.int32)

    def run_tokens(self, r: int) -> np.ndarray:
        call, piece, off = self.run_src[r]
        return self.seqs[call][piece][off : off + self.run_len[r]]

    def _end_depth(self, pair: tuple[int, int]) -> int:
        return self.run_depth[pair[0]] + pair[1]

    def _truncate(self, path: list[tuple[int, int]], m: int) -> list[tuple[int, int]]:
        """The first m nodes of a path (bisect over the pairs' end depths)."""
        if m == 0:
            return []
        i = bisect.bisect_left(path, m, key=self._end_depth)
        r = path[i][0]
        return path[:i] + [(r, m - self.run_depth[r])]

    def _token_at(self, call: int, k: int) -> int:
        prompt, completion = self.seqs[call]
        return int(prompt[k]) if k < prompt.size else int(completion[k - prompt.size])

    def _new_run(self, call: int, piece: int, off: int, n: int, parent: int, depth: int) -> int:
        r, s = len(self.run_start), self.n_nodes
        self.run_start.append(s)
        self.run_len.append(n)
        self.run_parent.append(parent)
        self.run_depth.append(depth)
        self.run_src.append((call, piece, off))
        first = int(self.seqs[call][piece][off])
        self.children.setdefault(parent, {}).setdefault(first, []).append(r)
        self.n_nodes += n
        if self.gen.size < self.n_nodes:
            grow = max(self.n_nodes, 2 * self.gen.size) - self.gen.size
            self.gen = np.concatenate([self.gen, np.zeros(grow, np.int32)])
            self.logp = np.concatenate([self.logp, np.zeros(grow, np.float32)])
            self.version = np.concatenate([self.version, np.zeros(grow, np.int32)])
        self.gen[s : s + n] = call if piece else -1
        if piece:
            rec = self.records[call]
            self.logp[s : s + n] = rec.logprobs[off : off + n]
            self.version[s : s + n] = rec.versions[off : off + n]
        return r

    def _candidates(self, path: list[tuple[int, int]], token: int) -> list[tuple[int, int]]:
        """Where ``token`` can follow the path's end, oldest first: (run, nodes before it)."""
        node, own = -1, []
        if path:
            r, t = path[-1]
            node = self.run_start[r] + t - 1
            if t < self.run_len[r] and int(self.run_tokens(r)[t]) == token:
                own = [(r, t)]
        return own + [(r2, 0) for r2 in self.children.get(node, {}).get(token, ())]

    def _same_behaviour(self, nodes: slice, call: int, j: slice) -> np.ndarray:
        """bool per node: context, or generated as ``call``'s completion[j] was."""
        rec = self.records[call]
        same = (self.version[nodes] == rec.versions[j]) & np.isclose(
            rec.logprobs[j], self.logp[nodes], rtol=SAME_LOGP_TOL, atol=SAME_LOGP_TOL
        )
        return (self.gen[nodes] < 0) | same

    def _pick_for_completion(self, i: int, j: int, cands: list[tuple[int, int]]):
        """The oldest candidate that is context or shares call i's behaviour at completion[j]."""
        for r, t in cands:
            s = self.run_start[r] + t
            if self._same_behaviour(slice(s, s + 1), i, slice(j, j + 1))[0]:
                return r, t
        return None

    def _before_twin(self, first: int, m: int) -> int:
        """m cut so that nodes first .. first+m-1 pass no twin node before their last."""
        k = bisect.bisect_left(self.twins, first)
        if k < len(self.twins) and self.twins[k] < first + m - 1:
            return self.twins[k] - first + 1
        return m

    @staticmethod
    def _take(path: list[tuple[int, int]], r: int, t: int, m: int) -> None:
        """Extends a path by m nodes of run r after its first t (in place)."""
        if t:
            path[-1] = (r, t + m)
        else:
            path.append((r, m))

    def _follow_prompt(self, prompt, k: int, path, r: int, t: int) -> int:
        """Follows run r after its first t nodes while the prompt from k agrees, up to the next
        twin (extending the path in place); returns the new k."""
        m = _lcp(prompt[k:], self.run_tokens(r)[t:])
        m = self._before_twin(self.run_start[r] + t, m)
        self._take(path, r, t, m)
        return k + m

    def _descend_prompt(self, i: int, k: int, path: list[tuple[int, int]]):
        """The deepest path of existing nodes that call i's prompt follows from (k, path).

        Depth-first: where siblings carry the same token (at twins), every branch is tried,
        oldest first, and a later one wins only by reaching deeper. Each node is read once.
        """
        prompt, best, todo = self.seqs[i][0], None, [(k, path)]
        while todo:
            k, path = todo.pop()
            while k < prompt.size:
                cands = self._candidates(path, int(prompt[k]))
                if not cands:
                    break
                for r, t in reversed(cands[1:]):  # tried after this branch, oldest first
                    alt = list(path)
                    todo.append((self._follow_prompt(prompt, k, alt, r, t), alt))
                k = self._follow_prompt(prompt, k, path, *cands[0])
            if best is None or k > best[0]:
                best = (k, path)
        return best

    def _follow_completion(self, i: int, j: int, path: list[tuple[int, int]], r: int, t: int):
        """Follows run r after its first t nodes while call i's completion from j agrees in
        token and behaviour, claiming the context nodes it generated; returns the count."""
        s, (_, completion) = self.run_start[r] + t, self.seqs[i]
        m = _lcp(completion[j:], self.run_tokens(r)[t:])
        same = self._same_behaviour(slice(s, s + m), i, slice(j, j + m))
        m = m if same.all() else int(same.argmin())
        claim = s + np.flatnonzero(self.gen[s : s + m] < 0)
        self.gen[claim] = i
        self.logp[claim] = self.records[i].logprobs[claim - s + j]
        self.version[claim] = self.records[i].versions[claim - s + j]
        self._take(path, r, t, m)
        return m

    def insert(self, i: int, guide: int | None) -> None:
        """Adds call i; its prompt follows the guide call's path as far as the two agree."""
        prompt, completion = self.seqs[i]
        n_prompt, total = prompt.size, prompt.size + completion.size
        k, path = 0, []
        if guide is not None:  # prompt tokens only: completions must match behaviours too
            k = min(_lcp_calls(self.seqs[i], self.seqs[guide]), n_prompt)
            path = self._truncate(self.paths[guide], k)
        k, path = self._descend_prompt(i, k, path)
        cands = []
        while n_prompt <= k < total:
            cands = self._candidates(path, self._token_at(i, k))
            pick = self._pick_for_completion(i, k - n_prompt, cands)
            if pick is None:
                break
            k += self._follow_completion(i, k - n_prompt, path, *pick)
        if k < total:
            node = self.run_start[path[-1][0]] + path[-1][1] - 1 if path else -1
            if cands and node not in self.twins:  # siblings with one token, two behaviours
                bisect.insort(self.twins, node)
            if k < n_prompt:
                r = self._new_run(i, 0, k, n_prompt - k, node, k)
                path.append((r, n_prompt - k))
                node, k = self.run_start[r] + n_prompt - k - 1, n_prompt
            r = self._new_run(i, 1, k - n_prompt, total - k, node, k)
            path.append((r, total - k))
        self.paths.append(path)


def build_tree(records: list[CallRecord]) -> Tree:
    """All calls of one (validated) execution -> its token trie."""
    index = {rec.call_id: i for i, rec in enumerate(records)}
    b = _Builder(records)
    for i, rec in enumerate(records):
        # the guide: the call this one continues (its parent), else the previous call
        guide = index.get(rec.parent_id, i - 1)
        if guide >= i:
            guide = i - 1
        b.insert(i, guide if guide >= 0 else None)
    return _finalise(b, records)


def _finalise(b: _Builder, records: list[CallRecord]) -> Tree:
    n = b.n_nodes
    run_start = np.asarray(b.run_start, np.int64)
    run_len = np.asarray(b.run_len, np.int64)
    tokens = np.concatenate([b.run_tokens(r) for r in range(len(run_start))]).astype(np.int32)
    parent = np.arange(-1, n - 1, dtype=np.int32)
    parent[run_start] = b.run_parent
    depth = (np.arange(n) - np.repeat(run_start - np.asarray(b.run_depth), run_len)).astype(
        np.int32
    )
    trainable = b.gen[:n] >= 0
    logp = np.where(trainable, b.logp[:n], 0).astype(np.float32)
    version = np.where(trainable, b.version[:n], -1).astype(np.int32)
    call_end = np.asarray([b.run_start[p[-1][0]] + p[-1][1] - 1 for p in b.paths], np.int32)
    has_child = np.ones(n, bool)
    has_child[run_start + run_len - 1] = False
    branch_nodes = [node for node in b.children if node >= 0]
    has_child[branch_nodes] = True
    is_leaf = ~has_child[call_end]
    _, first = np.unique(call_end, return_index=True)  # first call ending at each node
    owner = np.zeros(len(records), bool)
    owner[first] = True
    return Tree(
        execution_id=records[0].execution_id,
        end_reason=records[0].end_reason,
        tokens=tokens,
        parent=parent,
        depth=depth,
        trainable=trainable,
        logp=logp,
        version=version,
        run_start=run_start.astype(np.int32),
        run_len=run_len.astype(np.int32),
        call_ids=tuple(rec.call_id for rec in records),
        call_roles=tuple(rec.role for rec in records),
        call_paths=tuple(tuple(p) for p in b.paths),
        call_end=call_end,
        leaf_calls=np.flatnonzero(is_leaf & owner).astype(np.int32),
        trainable_cum=np.concatenate([[0], np.cumsum(trainable, dtype=np.int64)]),
    )
