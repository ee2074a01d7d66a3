"""The trainer's staleness rule in split placement: a group older than k is never trained on, and
no fresh group is lost on the way (stale_groups=wait carries the groups past a batch to the next)."""
import contextlib
import types

import pytest

from verl_hpc.data.batch import PromptBatch
from verl_hpc.rollout.result import RolloutResult
from verl_hpc.trainer.placement.async_link import AsyncLink, select_fresh, staleness_metrics
from verl_hpc.trainer.placement.inflight import BatchRecord, Groups


def groups(versions_per_group, n=2, name="p"):
    count = len(versions_per_group)
    prompts = PromptBatch(ids=[f"{name}{i}" for i in range(count)], prompt_ids=[[1, 2]] * count,
                          prompt_texts=[""] * count, data_sources=["s"] * count, ground_truths=["1"] * count,
                          extras=[{}] * count)
    idx = [i for i in range(count) for _ in range(n)]
    vs = [versions_per_group[i] for i in idx]
    result = RolloutResult(prompts=[[1, 2]] * count, prompt_index=idx,
                           sample_index=[j for _ in range(count) for j in range(n)],
                           response_ids=[[5] * len(v) for v in vs], logprobs=[[-1.0] * len(v) for v in vs],
                           finish_reason=["stop"] * len(vs), versions=[list(v) for v in vs])
    return Groups(prompts, result)


def test_a_group_older_than_k_is_dropped():
    # trainer at version 5, k = 2: a group whose oldest token is version 2 (3 behind) goes, even when
    # its later tokens are fresh (partial rollout across updates); a group without tokens stays
    g = groups([[5, 5], [3, 4], [2, 5], [4], []])
    keep, dropped = select_fresh(g, 5, 2)
    assert keep == [0, 1, 3, 4] and dropped == 1
    kept = g.select(keep)
    assert kept.prompts.ids == ["p0", "p1", "p3", "p4"] and kept.result.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3]
    assert min(5 - v for seq in kept.versions for v in seq) >= 0
    assert max(5 - v for seq in kept.versions for v in seq) <= 2
    m = staleness_metrics(kept.versions, 5, 2)
    assert m["async/staleness_max"] == 2 and m["async/staleness/hist/0"] == 2 + 2  # p0's four tokens


def test_concat_and_split_keep_every_group_once():
    a, b = groups([[1], [1]], name="a"), groups([[1], [1], [1]], name="b")
    both = Groups.concat([a, b])
    head, rest = both.split(3)
    assert head.prompts.ids == ["a0", "a1", "b0"] and head.result.prompt_index == [0, 0, 1, 1, 2, 2]
    assert rest.prompts.ids == ["b1", "b2"] and rest.result.prompt_index == [0, 0, 1, 1] and len(rest.versions) == 4
    assert both.split(5) == (both, None)


class _Mailbox:
    def __init__(self, records):
        self.items = {f"batch/{r.index}": r for r in records}

    def wait(self, key, who, timeout_s, unless=None):
        assert key in self.items, f"the trainer asked for {key}, which the rollout never made"
        return True

    def take(self, key):
        return self.items.pop(key)


def _link(records, k, policy, batch):
    """An AsyncLink's batch selection without the process groups (one training rank)."""
    link = AsyncLink.__new__(AsyncLink)
    link.cfg = types.SimpleNamespace(data=types.SimpleNamespace(train_batch_size=batch))
    link.mb, link.leader, link.k, link.wait_policy = _Mailbox(records), True, k, policy == "wait"
    link.timeout_s, link.next_index, link.leftover, link.trained_ids = 1.0, 1, None, []
    return link


def _timer(name):  # StageTimer's call shape, timing nothing
    return contextlib.nullcontext()


def test_wait_policy_trains_every_fresh_group_exactly_once(monkeypatch):
    monkeypatch.setattr("verl_hpc.trainer.placement.async_link.broadcast_object", lambda x: x)
    # batch 1 all fresh; batch 2 has one stale group (version 0 at step 3 with k = 1) and three fresh
    recs = [BatchRecord(1, groups([[0], [0], [0], [0]], name="x"), {}),
            BatchRecord(2, groups([[0], [1], [1], [1]], name="y"), {}),
            BatchRecord(3, groups([[2], [2], [2], [2]], name="z"), {})]
    link = _link(recs, k=1, policy="wait", batch=4)
    seen = []
    for step in (1, 2, 3):
        prompts, result, m = link.next_batch(step, 0, _timer)
        assert len(prompts) == 4 and len(result) == 8
        seen += prompts.ids
    # y0 (version 0) is 1 behind at step 2 (version 1): within k = 1, so nothing waits or drops
    assert seen[:4] == ["x0", "x1", "x2", "x3"] and seen[4:8] == ["y0", "y1", "y2", "y3"]
    assert seen[8:] == ["z0", "z1", "z2", "z3"] and link.leftover is None


def test_wait_policy_carries_the_groups_past_the_batch(monkeypatch):
    monkeypatch.setattr("verl_hpc.trainer.placement.async_link.broadcast_object", lambda x: x)
    recs = [BatchRecord(1, groups([[0], [0], [0], [0]], name="x"), {}),
            BatchRecord(2, groups([[0], [1], [1], [1]], name="y"), {}),
            BatchRecord(3, groups([[1], [2], [2], [2]], name="z"), {}),
            BatchRecord(4, groups([[2], [2], [2], [2]], name="w"), {})]
    link = _link(recs, k=0, policy="wait", batch=4)
    link.next_batch(1, 0, _timer)  # x: version 0, fresh
    prompts, _, m = link.next_batch(2, 0, _timer)  # y0 is stale at version 1 with k = 0: z0 is too
    assert m["async/dropped_groups"] == 1 and prompts.ids == ["y1", "y2", "y3", "z0"]
    assert link.leftover.prompts.ids == ["z1", "z2", "z3"]  # not lost: the next step starts with them
    prompts, _, m = link.next_batch(3, 0, _timer)  # version 2: the carried groups first, then batch 4
    assert prompts.ids == ["z1", "z2", "z3", "w0"] and m["async/dropped_groups"] == 0
    assert link.leftover.prompts.ids == ["w1", "w2", "w3"]


def test_drop_policy_takes_the_next_batch_when_all_groups_are_stale(monkeypatch):
    monkeypatch.setattr("verl_hpc.trainer.placement.async_link.broadcast_object", lambda x: x)
    recs = [BatchRecord(1, groups([[0], [0]], name="x"), {}), BatchRecord(2, groups([[4], [3]], name="y"), {})]
    link = _link(recs, k=1, policy="drop", batch=2)
    prompts, _, m = link.next_batch(5, 0, _timer)  # version 4: x (version 0) is 4 behind
    assert prompts.ids == ["y0", "y1"] and m["async/dropped_groups"] == 2


class _Recorder:
    def __init__(self):
        self.items = {}

    def put(self, key, value):
        self.items[key] = value


def test_split_resume_of_a_colocated_checkpoint_goes_on_with_its_data_cursor(monkeypatch):
    monkeypatch.setattr("verl_hpc.trainer.placement.async_link.broadcast_object", lambda x: x)
    link = _link([], k=1, policy="drop", batch=2)
    link.mb, link.resume_state, link.data_cursor = _Recorder(), None, None
    cursor = {"batch_size": 2, "sampler": {"epoch": 0, "position": 14}, "step": 7}
    link.load_state_dict(cursor)  # what a colocated run's TrainerCheckpointer saved for its PromptLoader
    link.start(7)
    assert link.next_index == 8 and link.mb.items["ctl/start"]["loader"] == cursor
    assert link.mb.items["ctl/start"]["next_index"] == 8 and link.mb.items["ctl/start"]["inflight"] is None


def test_a_colocated_run_refuses_a_split_checkpoints_stream():
    from verl_hpc.data import PromptLoader
    from verl_hpc.data.dataset import PromptDataset
    from verl_hpc.data.records import PromptRecord
    from verl_hpc.errors import VerlHpcError

    records = [PromptRecord(f"t:{i}", f"{i}+1=", "s", str(i + 1)) for i in range(4)]
    loader = PromptLoader(PromptDataset(records, [r.prompt for r in records], [[i] for i in range(4)]), 2)
    with pytest.raises(VerlHpcError, match="written by a split placement run .* resume it with placement.mode = split"):
        loader.load_state_dict({"split_async": "..."})  # a split run's loader entry, not a PromptLoader's
