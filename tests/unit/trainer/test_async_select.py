"""The trainer's staleness rule in split placement: a group older than k is never trained on."""
from verl_hpc.data.batch import PromptBatch
from verl_hpc.rollout.result import RolloutResult
from verl_hpc.trainer.loops.async_link import _concat, select_fresh, staleness_metrics, subset
from verl_hpc.trainer.loops.inflight import BatchRecord


def record(versions_per_group, n=2):
    groups = len(versions_per_group)
    prompts = PromptBatch(ids=[f"p{i}" for i in range(groups)], prompt_ids=[[1, 2]] * groups,
                          prompt_texts=[""] * groups, data_sources=["s"] * groups, ground_truths=["1"] * groups,
                          extras=[{}] * groups)
    idx = [i for i in range(groups) for _ in range(n)]
    vs = [versions_per_group[i] for i in idx]
    result = RolloutResult(prompts=[[1, 2]] * groups, prompt_index=idx, sample_index=[j for _ in range(groups)
                                                                                      for j in range(n)],
                           response_ids=[[5] * len(v) for v in vs], logprobs=[[-1.0] * len(v) for v in vs],
                           finish_reason=["stop"] * len(vs))
    return BatchRecord(7, prompts, result, [list(v) for v in vs], {})


def test_a_group_older_than_k_is_dropped():
    # trainer at version 5, k = 2: a group whose oldest token is version 2 (3 behind) goes, even when
    # its later tokens are fresh (partial rollout across updates)
    rec = record([[5, 5], [3, 4], [2, 5], [4]])
    keep, dropped = select_fresh(rec, 5, 2)
    assert keep == [0, 1, 3] and dropped == 1
    prompts, result, versions = subset(rec, keep)
    assert prompts.ids == ["p0", "p1", "p3"] and result.prompt_index == [0, 0, 1, 1, 2, 2]
    assert min(5 - v for seq in versions for v in seq) >= 0 and max(5 - v for seq in versions for v in seq) <= 2
    m = staleness_metrics(versions, 5, 2)
    assert m["async/staleness_max"] == 2 and m["async/staleness/hist/0"] == 2 + 2  # p0's four tokens


def test_concat_keeps_at_most_the_batch():
    a, b = record([[1], [1]]), record([[1], [1], [1]])
    prompts, result, versions = _concat([subset(a, [0, 1]), subset(b, [0, 1, 2])], 3)
    assert len(prompts) == 3 and result.prompt_index == [0, 0, 1, 1, 2, 2] and len(versions) == 6
