"""VLLMRollout on 2 real gloo ranks: inference TP=2 (one replica) and TP=1 (two replicas, uneven
shards), each with a weight update, in one launch (spawning and importing vLLM is the expensive
part). Every rank must return the same global result, equal to transformers' greedy decode of the
same (and of the updated) weights; close() must leave the job's process group working; CPU
shared-memory segments must carry the job's token and go away with the job.
"""
import os

import pytest
from hf_reference import hf_greedy_from, perturbed_state
from rol_ranks import launch


TOL = 1e-4
MAX_PROMPT, MAX_NEW = 192, 12
LENGTHS = (3, 17, 40, 64, 150)  # 5 prompts: the two TP=1 replicas take 3 and 2


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The references below run tiny models: one thread (see tests/unit/rollout/conftest.py)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prompts():
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(5, 480, (n,), generator=gen).tolist() for n in LENGTHS]


def _check(result, reference, label):
    assert result["prompt_index"] == list(range(len(LENGTHS))), label
    assert result["response_ids"] == [toks for toks, _ in reference], label
    diff = max(abs(a - b) for got, (_, ref) in zip(result["logprobs"], reference)
               for a, b in zip(got, ref))
    assert diff <= TOL, (label, diff)
    return diff


def test_tp2_and_two_tp1_replicas_match_transformers(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    model = str(make_tiny_model(tmp_path_factory.mktemp("rol_dist") / "llama", "llama"))
    prompts = _prompts()
    port, ranks = launch(2, dict(model=model, prompts=prompts, max_prompt=MAX_PROMPT,
                                 max_new=MAX_NEW), tmp_path_factory.mktemp("rol_ranks"))
    ref = hf_greedy_from(model, prompts, MAX_NEW)
    ref_new = hf_greedy_from(model, prompts, MAX_NEW, state=perturbed_state(model))

    for key in ("tp2", "tp2_sampled", "tp2_updated", "tp1", "tp1_sampled", "tp1_updated"):
        assert ranks[0][key] == ranks[1][key], f"{key}: ranks returned different results"
    for tp in (2, 1):
        before = _check(ranks[0][f"tp{tp}"], ref, f"tp{tp}")
        after = _check(ranks[0][f"tp{tp}_updated"], ref_new, f"tp{tp} after load_weights")
        print(f"inference tp={tp}: max |logprob diff| vs transformers {before:.2e}, "
              f"after update {after:.2e}; load {ranks[0][f'tp{tp}_load']}")
        sampled = ranks[0][f"tp{tp}_sampled"]
        assert sampled["prompt_index"] == [i for i in range(len(LENGTHS)) for _ in range(2)]
        assert sampled["sample_index"] == [0, 1] * len(LENGTHS)
        for r in ranks:
            assert r[f"tp{tp}_dist_after_close"], f"torch.distributed broken after tp={tp} close()"
    same = ranks[0]["tp2_sampled"]["response_ids"] == ranks[0]["tp1_sampled"]["response_ids"]
    print(f"seeded samples equal across layouts (TP=2 vs 2 x TP=1): {same}")

    token = ranks[0]["token"]
    ours = [n for n in ranks[0]["shm"] if n.startswith(token + "_")]
    print(f"CPU shared-memory segments while TP=2 ran: {ours}")
    assert token == f"verlhpc-127.0.0.1-{port}"
    if ranks[0]["shm_op"]:  # vLLM's shared-memory communicator ran: its segments carry our job token
        # (the list is the node's: a job of the other test worker maps segments under its own token;
        # none may carry vLLM's default name, which two jobs on one node would share)
        assert len(ours) == 2 and all(n.startswith("verlhpc-") for n in ranks[0]["shm"]), ranks[0]["shm"]
    else:  # this vLLM build has no shared-memory op: TP ran over torch.distributed, no segment at all
        print("this vLLM build has no CPU shared-memory op (torch.ops._C.init_shm_manager): TP=2 used torch.distributed")
        assert ranks[0]["shm"] == [], ranks[0]["shm"]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(token + "_")], "segments left"
