"""Continuous batching over a paged KV pool: block allocator, radix prefix cache, EDF admission.

Pure Python on ints. A `Seq` is one question's token stream (stem, then thought); a group is one request's
seqs. Each `schedule()` returns at most one `Work` per running seq (prefill chunk, decode row, readout
probe); the engine runs them as one model step and calls `complete()`, then tells each idle seq what it
wants next (`extend`) or that it is done (`finish`).

KV blocks hold 16 positions. Memory: at admission a seq reserves every block it may ever need
(stem + thought limit + 1 probe position), so an admitted seq always finishes: no preemption, no
deadlock. Blocks are allocated lazily against that reservation.

Prefix cache: a radix tree over FULL stem blocks. A node is keyed by (parent block, its 16 token ids,
digests of the images overlapping it); since the parent is itself a node, a match means "these 16 tokens
and everything before them are equal". A stem's full blocks are inserted at admission, not ready; they
become ready (shareable) once their KV is computed. A seq whose chain runs into a not-ready node waits
(stays unadmitted) until the owner computed it: so questions of one request compute their shared
context once. Unreferenced ready nodes sit in an LRU list and are evicted (with their subtree, which is
then unreferenced too: a holder of a node holds its whole chain) only when a free block is needed.
Thought blocks and the partial last stem block are never shared.

Probes (readout rows of `<channel|>`) write KV at positions >= `done` that are not kept: the next kept
token overwrites the same slot before any later row can read it, and those slots are always in private
blocks (the block holding position len(stem) is partial or past the stem), so the readout cannot leak
into the thought and no scratch block is needed.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

BLOCK = 16
INF = float("inf")


class TooLarge(ValueError):
    """A seq that can never fit in the KV pool (engine: 413 too_large)."""


class Seq:
    def __init__(self, tokens, max_positions, images=(), tag=None):
        self.tokens = list(tokens)          # kept tokens: stem, then thought tokens fed so far
        self.prompt_len = len(self.tokens)
        self.images = tuple(images)         # ((start, n, digest), ...) <|image|> runs, ascending
        self.need = math.ceil(max_positions / BLOCK)   # blocks reserved at admission
        self.tag = tag                      # the engine's handle
        self.group = None                   # the tag of its group (request), set by add()
        self.done = 0                       # positions 0..done-1 hold computed, kept KV
        self.blocks: list[int] = []
        self.cached = 0                     # stem tokens taken from the prefix cache
        self.reserve = 0                    # reserved blocks not yet allocated
        self.probe, self.readout, self.argmax = (), (), True   # what the stem's last chunk returns (extend)
        self.idle, self.running, self.finished = False, False, False
        self.owned = []                     # trie nodes this seq inserted (not ready until computed)


@dataclass(slots=True)             # not frozen, a per-step record: see model.SeqStep
class Work:
    seq: Seq
    tokens: tuple[int, ...]
    start: int
    blocks: tuple[int, ...]
    readout: tuple[int, ...]                # key logits at the last row
    argmax: bool                            # the greedy token of the last kept row (row keep - 1)
    images: tuple[int, ...]                 # indexes into seq.images that lie inside this chunk
    keep: int                               # leading tokens that stay in the sequence
    final: bool                             # the last row answers the seq's request (readout / argmax)
    split: bool                             # _split(argmax, readout, keep, len(tokens)): see there


def _split(argmax, readout, keep, rows):
    """The greedy token of the last kept row and key logits after probe rows (the stem's last chunk, then
    `<channel|>`): two sequences of the model step (engine._model_step), counted so against max_seqs."""
    return bool(argmax and readout and keep < rows)


# --- blocks and the radix prefix cache ------------------------------------------------------------

class BlockPool:
    def __init__(self, num_blocks: int, cache: bool = True):
        self.num_blocks, self.cache = num_blocks, cache
        self.free = list(range(num_blocks - 1, -1, -1))   # pop() hands out low ids first
        self.ref = [0] * num_blocks
        self.trie: dict[tuple, int] = {}        # (parent block | -1, tokens16, digests) -> block
        self.key: dict[int, tuple] = {}         # block -> its trie key
        self.children: dict[int, set] = {}
        self.ready: set[int] = set()
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced ready nodes, oldest first
        self.reserved = 0                       # promised to admitted seqs, not yet allocated

    def available(self) -> int:
        return len(self.free) + len(self.lru) - self.reserved

    def used(self) -> int:
        return self.num_blocks - len(self.free) - len(self.lru)

    def alloc(self) -> int:
        if not self.free:
            self._drop(next(iter(self.lru)))   # evict the least recently used subtree
        b = self.free.pop()
        self.ref[b] = 1
        return b

    def incref(self, b):
        self.lru.pop(b, None)
        self.ref[b] += 1

    def decref(self, b):
        self.ref[b] -= 1
        if self.ref[b]:
            return
        if b in self.ready:
            self.lru[b] = None                  # cached: evictable, most recent last
        elif b in self.key:
            self._drop(b)                       # its owner left before computing it
        else:
            self.free.append(b)

    def _drop(self, b):
        for c in list(self.children.pop(b, ())):
            self._drop(c)
        k = self.key.pop(b)
        del self.trie[k]
        if k[0] >= 0:
            self.children[k[0]].discard(b)
        self.ready.discard(b)
        self.lru.pop(b, None)
        if self.ref[b] == 0:
            self.free.append(b)

    def insert(self, key, b):
        self.trie[key], self.key[b] = b, key
        if key[0] >= 0:
            self.children.setdefault(key[0], set()).add(b)


# --- the scheduler --------------------------------------------------------------------------------

class Scheduler:
    def __init__(self, num_blocks, max_batch=64, prefill_chunk=512, step_tokens=None, prefix_cache=True,
                 serial=False, max_rows=None, max_seqs=None):
        self.pool = BlockPool(num_blocks, prefix_cache)
        self.max_batch, self.chunk, self.serial = max_batch, prefill_chunk, serial
        self.step_tokens = step_tokens or 4 * prefill_chunk   # prefill tokens per step (decode rows aside)
        self.max_rows = max_rows            # the model's rows per step (every row: decode, chunks, probes); None: any
        self.max_seqs = max_seqs            # the model's sequences per step (a split work is two); None: any
        self.waiting: list[list] = []       # groups: [order key, seqs not yet admitted, tag]
        self.running: list[Seq] = []        # admission order
        self.active = {}                    # group tag -> seqs not finished (serial: one group at a time)
        self.n = 0
        self.hit_tokens = self.lookup_tokens = 0

    # -- admission
    def add(self, seqs, deadline=None, arrival=0.0, tag=None):
        """Queue a group (one request). Raises TooLarge if one of its seqs can never fit."""
        for s in seqs:
            if s.need > self.pool.num_blocks:
                raise TooLarge(f"a question needs {s.need * BLOCK} KV positions; the pool has "
                               f"{self.pool.num_blocks * BLOCK}")
        self.n += 1
        key = (arrival, self.n) if self.serial else (INF if deadline is None else deadline, arrival, self.n)
        self.waiting.append([key, list(seqs), tag])
        self.active[tag] = set(seqs)
        for s in seqs:
            s.group = tag

    def cancel(self, tag):
        """Remove a group: its waiting seqs never start, its running ones are dropped."""
        self.waiting = [g for g in self.waiting if g[2] != tag]
        for s in list(self.active.pop(tag, ())):
            self.finish(s, group=False)

    def _admit(self):
        self.waiting.sort(key=lambda g: g[0])
        for g in list(self.waiting):
            if self.serial and any(t != g[2] for t in self.active if self.begun(t)):
                return
            for s in list(g[1]):
                if len(self.running) >= self.max_batch:
                    return
                r = self._place(s)
                if r is None:
                    continue        # waits for a shared block another seq is computing
                if not r:
                    return          # strict EDF: nothing overtakes a seq that does not fit yet
                g[1].remove(s)
            if not g[1]:
                self.waiting.remove(g)
            if self.serial:
                return

    def begun(self, tag) -> bool:
        """Whether any seq of the group was admitted (a request that has started)."""
        return any(s.running or s.finished for s in self.active.get(tag, ()))

    def _keys(self, s, j):
        lo, hi = j * BLOCK, (j + 1) * BLOCK
        return tuple(s.tokens[lo:hi]), tuple(d for a, n, d in s.images if a < hi and a + n > lo) if s.images else ()

    def _place(self, s):
        """Admit s if its blocks fit: True; no room yet: False; a shared block is being computed: None."""
        p, chain, parent = self.pool, [], -1
        full = s.prompt_len // BLOCK                 # full stem blocks (shareable)
        if p.cache:
            for j in range((s.prompt_len - 1) // BLOCK):   # keep >= 1 stem token to compute (its argmax)
                b = p.trie.get((parent, *self._keys(s, j)))
                if b is None:
                    break
                if b not in p.ready:
                    return None
                chain.append(b)
                parent = b
            for a, n, _ in reversed(s.images):       # never start computing inside an image run
                if a < len(chain) * BLOCK < a + n:
                    chain = chain[:a // BLOCK]
        evictable = sum(1 for b in chain if p.ref[b] == 0)
        if s.need - len(chain) + evictable > p.available():
            return False
        for b in chain:
            p.incref(b)
        s.blocks, s.done = list(chain), len(chain) * BLOCK
        s.cached = s.done
        s.reserve = s.need - len(chain)
        p.reserved += s.reserve
        parent = chain[-1] if chain else -1
        for j in range(len(chain), math.ceil(s.prompt_len / BLOCK)):   # stem blocks now: insert in trie
            b = self._alloc(s)
            if p.cache and j < full and parent is not None:
                key = (parent, *self._keys(s, j))
                if key in p.trie:
                    parent = None                    # a duplicate of a cached block: stays private
                else:
                    p.insert(key, b)
                    s.owned.append(b)
                    parent = b
        self.hit_tokens += s.cached
        self.lookup_tokens += s.prompt_len
        s.running = True
        self.running.append(s)
        return True

    def _alloc(self, s):
        if s.reserve <= 0:
            raise RuntimeError("seq exceeded its KV reservation")
        s.reserve -= 1
        self.pool.reserved -= 1
        b = self.pool.alloc()
        s.blocks.append(b)
        return b

    # -- steps
    def schedule(self) -> list[Work]:
        self._admit()
        works, budget, rows, nseq = [], self.step_tokens, 0, 0
        for prefill in (False, True):               # decode and readout rows first: they are cheap
            for s in self.running:
                if s.idle or (s.done < s.prompt_len) != prefill:
                    continue
                a = s.done
                b = self._chunk_end(s, a) if prefill else len(s.tokens)
                if prefill and budget < self.step_tokens and b - a > budget:
                    continue                         # whole chunks only: boundaries never depend on load
                final = b == len(s.tokens)
                toks = tuple(s.tokens[a:b]) + (s.probe if final else ())
                split = _split(s.argmax and final, s.readout if final else (), b - a, len(toks))
                n = 1 + split
                if works and ((self.max_rows is not None and rows + len(toks) > self.max_rows) or
                              (self.max_seqs is not None and nseq + n > self.max_seqs)):
                    continue                         # the model's workspace: this seq goes in a later step
                rows, nseq = rows + len(toks), nseq + n
                end = a + len(toks)
                while len(s.blocks) * BLOCK < end:
                    self._alloc(s)
                ims = tuple(i for i, (st, n, _) in enumerate(s.images) if a <= st and st + n <= b) if s.images else ()
                works.append(Work(s, toks, a, tuple(s.blocks[:-(-end // BLOCK)]),
                                  s.readout if final else (), s.argmax and final, ims, b - a, final, split))
                if prefill:
                    budget -= b - a
        return works

    def _chunk_end(self, s, a):
        # Cuts sit at multiples of prefill_chunk (absolute positions), so a cache hit changes only the
        # first chunk of a stem: the rest is chunked exactly as without the cache.
        b = min(s.prompt_len, (a // self.chunk + 1) * self.chunk)
        for st, n, _ in s.images:                    # move the cut out of any image run
            if st < b < st + n:
                b = st if st > a else st + n
        return b

    def complete(self, works):
        """After the model step ran `works`: advance kept positions, publish computed stem blocks."""
        p = self.pool
        for w in works:
            s = w.seq
            s.done += w.keep
            while s.owned and (s.blocks.index(s.owned[0]) + 1) * BLOCK <= s.done:
                p.ready.add(s.owned.pop(0))
            if w.final:
                s.idle = True

    def extend(self, s, feed=(), probe=(), readout=(), argmax=False):
        """The seq's next work: keep `feed`, then probe rows; readout keys at the last row, argmax at the last
        kept one. Before admission: what the stem's last chunk returns (and which probe rows follow it)."""
        s.tokens += feed
        s.probe, s.readout, s.argmax, s.idle = tuple(probe), tuple(readout), argmax, False

    def finish(self, s, group=True):
        """Release s: its stem blocks stay cached (if computed), the rest return to the pool."""
        if s.finished:
            return
        s.finished, s.idle = True, True
        if s.running:
            self.running.remove(s)
        for b in reversed(s.blocks):                 # leaves first into the LRU: evicted before roots
            self.pool.decref(b)
        self.pool.reserved -= s.reserve
        s.blocks, s.reserve, s.owned = [], 0, []
        live = self.active.get(s.group)
        if live is not None:
            live.discard(s)
            if not live and group:
                del self.active[s.group]

    # -- numbers for health and metrics
    def stats(self) -> dict:
        p = self.pool
        return {"waiting_seqs": sum(len(g[1]) for g in self.waiting), "running_seqs": len(self.running),
                "blocks_used": p.used(), "blocks": p.num_blocks, "cached_blocks": len(p.ready),
                "hit_tokens": self.hit_tokens, "lookup_tokens": self.lookup_tokens}
