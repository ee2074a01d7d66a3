"""Deterministic, resumable samplers over dataset indices.

`EpochSampler` walks a fresh permutation each epoch; the permutation is a pure function of
(seed, epoch), so the sampler's whole position is (epoch, offset): two ints that go into the
checkpoint as they are (no pickled RNG state), and a resumed run draws exactly the indices the
uninterrupted one would have. Batches run on across epoch boundaries (no drop_last): every step
gets a full batch and no prompt is skipped.

The permutation uses a hand-written Fisher-Yates over `random.Random(str).random()`, the one part
of Python's RNG whose output is guaranteed stable across versions; numpy's and torch's shuffles
may change between releases, which would silently change a resumed run's data order.

`MixtureSampler` serves several data_sources at fixed weights by deterministic interleaving: each
draw goes to the source furthest behind its share (weight * draws so far - its count), so after
any number of draws every source is within one sample of its exact share, a batch's mix is as even
as its size allows, and the position is again plain ints (draws per source + each source's own
EpochSampler position).

`ShuffleStream` is the SFT program's order: one `random.Random(seed)` shuffles a fresh permutation
onto the stream whenever fewer indices than a batch are left, so a batch may span two epochs. Its
position is the number of indices taken; a resume replays the draws (cheap: index lists only).

There is no sharding: rank 0 samples the global batch and the trainer scatters it, so the data
order does not depend on the number of ranks and a job can resume at another world size.
"""
from __future__ import annotations

import random
from typing import Dict, Iterable, List, Mapping, Sequence, Union

from verl_hpc.data.errors import DataError

Seed = Union[int, str]


def permutation(size: int, seed: Seed, epoch: int) -> List[int]:
    rng = random.Random(f"verl_hpc:{seed}:{epoch}")  # str seeds hash with sha512: stable
    order = list(range(size))
    for i in range(size - 1, 0, -1):
        j = int(rng.random() * (i + 1))
        order[i], order[j] = order[j], order[i]
    return order


TRAIN_SET = "train set (data.train_files, data.prompt_key, data.max_prompt_length)"


class EpochSampler:
    def __init__(self, size: int, seed: Seed = 1, shuffle: bool = True, fingerprint: str = "",
                 data_name: str = TRAIN_SET):
        """`data_name`: what the fingerprint stands for, named when a resumed run's data differs."""
        if size <= 0:
            raise DataError(f"cannot sample from an empty dataset (size {size})")
        self.size, self.seed, self.shuffle, self.fingerprint = size, seed, shuffle, fingerprint or str(size)
        self.data_name = data_name
        self.epoch, self.offset = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> List[int]:
        return permutation(self.size, self.seed, self.epoch) if self.shuffle else list(range(self.size))

    def next_indices(self, count: int) -> List[int]:
        out: List[int] = []
        while len(out) < count:
            take = min(count - len(out), self.size - self.offset)
            out.extend(self._order[self.offset:self.offset + take])
            self.offset += take
            if self.offset == self.size:
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._make_order()
        return out

    def state_dict(self) -> Dict[str, Union[int, str]]:
        return {"kind": "epoch", "epoch": self.epoch, "offset": self.offset, "seed": str(self.seed),
                "shuffle": int(self.shuffle), "fingerprint": self.fingerprint}

    def load_state_dict(self, state: Mapping, strict: bool = True) -> None:
        _check_kind(state, "epoch")
        if strict:
            _check_same(state, "seed", str(self.seed), "data.seed")
            _check_same(state, "shuffle", int(self.shuffle), "data.shuffle")
            _check_same(state, "fingerprint", self.fingerprint, self.data_name)
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if not (epoch >= 0 and 0 <= offset < self.size):
            raise DataError(f"sampler state: position epoch {epoch}, offset {offset} is outside a dataset of "
                            f"{self.size} prompts")
        self.epoch, self.offset = epoch, offset
        self._order = self._make_order()


class ShuffleStream:
    def __init__(self, size: int, seed: Seed = 1, fingerprint: str = "", data_name: str = "SFT set (data.sft_files)"):
        if size <= 0:
            raise DataError(f"cannot sample from an empty dataset (size {size})")
        self.size, self.seed, self.fingerprint, self.data_name = size, seed, fingerprint or str(size), data_name
        self._restart()

    def _restart(self) -> None:
        self._rng = random.Random(self.seed)
        self._order: List[int] = []
        self.taken, self.batch_size = 0, 0

    def next_indices(self, count: int) -> List[int]:
        while len(self._order) < count:  # the next epoch(s), appended to what is left of this one
            perm = list(range(self.size))
            self._rng.shuffle(perm)
            self._order += perm
        out, self._order = self._order[:count], self._order[count:]
        self.taken, self.batch_size = self.taken + count, count
        return out

    def state_dict(self) -> Dict[str, Union[int, str]]:
        return {"kind": "stream", "taken": self.taken, "batch_size": self.batch_size, "seed": str(self.seed),
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: Mapping, strict: bool = True) -> None:
        _check_kind(state, "stream")
        if strict:
            _check_same(state, "seed", str(self.seed), "data.seed")
            _check_same(state, "fingerprint", self.fingerprint, self.data_name)
        taken, bs = int(state["taken"]), int(state["batch_size"])
        if taken < 0 or (taken and (bs <= 0 or taken % bs)):
            raise DataError(f"sampler state: {taken} indices taken in batches of {bs} is not a position of this stream")
        self._restart()
        for _ in range(taken // bs if bs else 0):  # the same draws, in the same batch sizes
            self.next_indices(bs)


class MixtureSampler:
    def __init__(self, groups: Mapping[str, Sequence[int]], weights: Mapping[str, float], seed: Seed = 1,
                 shuffle: bool = True, fingerprint: str = ""):
        _check_mixture(groups, weights)
        self.sources = sorted(s for s in weights if weights[s] > 0)  # sorted: ties break the same everywhere
        total = sum(weights[s] for s in self.sources)
        self.shares = {s: weights[s] / total for s in self.sources}
        self.groups = {s: list(groups[s]) for s in self.sources}
        self.samplers = {s: EpochSampler(len(self.groups[s]), f"{seed}:{s}", shuffle, f"{fingerprint}:{s}")
                         for s in self.sources}
        self.counts = {s: 0 for s in self.sources}
        self.fingerprint = fingerprint

    def _pick(self) -> str:
        n = sum(self.counts.values()) + 1
        return max(self.sources, key=lambda s: (self.shares[s] * n - self.counts[s], -self.sources.index(s)))

    def next_indices(self, count: int) -> List[int]:
        out = []
        for _ in range(count):
            s = self._pick()
            self.counts[s] += 1
            out.append(self.groups[s][self.samplers[s].next_indices(1)[0]])
        return out

    def state_dict(self) -> Dict:
        return {"kind": "mixture", "fingerprint": self.fingerprint, "counts": dict(self.counts),
                "samplers": {s: self.samplers[s].state_dict() for s in self.sources}}

    def load_state_dict(self, state: Mapping, strict: bool = True) -> None:
        _check_kind(state, "mixture")
        if sorted(state["counts"]) != self.sources:
            raise DataError(f"sampler state: saved for data.mixture sources {sorted(state['counts'])}, but this run "
                            f"mixes {self.sources}; resume with the same data.mixture")
        for s in self.sources:
            self.samplers[s].load_state_dict(state["samplers"][s], strict)
        self.counts = {s: int(state["counts"][s]) for s in self.sources}


def _check_kind(state: Mapping, kind: str) -> None:
    if state.get("kind") != kind:
        other = "data.mixture set" if kind == "mixture" else "no data.mixture"
        raise DataError(f"sampler state: saved by a {state.get('kind')!r} sampler, but this run ({other}) uses "
                        f"a {kind!r} one; resume with the data.mixture the checkpoint was made with")


def _check_same(state: Mapping, key: str, expected, field: str) -> None:
    if str(state.get(key)) != str(expected):
        raise DataError(f"sampler state: {key} {state.get(key)!r} in the checkpoint differs from {expected!r} "
                        f"in this run; resume with the same {field} (or load the state with strict=False)")


def _check_mixture(groups: Mapping[str, Sequence[int]], weights: Mapping[str, float]) -> None:
    problems = mixture_problems(groups, weights)
    if problems:
        raise DataError(problems[0])


def mixture_problems(sources: Iterable[str], weights: Mapping[str, float]) -> List[str]:
    """data.mixture against the data_source values of the train set's rows (those the job keeps):
    asked by the sampler at the job's start and by the submitter, which reads every row, before the
    queue (launcher/preflight_data.py)."""
    present = sorted(set(sources))
    unknown = sorted(set(weights) - set(present))
    if unknown:
        return [f"data.mixture: {unknown} not among the train set's data_source values; valid: {present}"]
    missing = sorted(set(present) - set(weights))
    if missing:
        return [f"data.mixture: no weight for data_source {missing}; give every source of the train set "
                f"a weight (0 leaves it out): {present}"]
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        return [f"data.mixture: weights must be >= 0 with a positive sum, got {dict(weights)}"]
    return []
