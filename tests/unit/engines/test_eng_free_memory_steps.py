"""The output layer's free-memory reading across steps (issue 85, suspect 10). Adam's moments
appear at the first optimizer step, so the memory free at the output layer of step 1 is larger
than at step 2 and after by their size: near the whole-or-chunks threshold the choice flipped
between step 1 and step 2. The engines take the moments not yet created off what they read
(logits.pending_adam_bytes), so every step's rule sees what a later step will hold.

On CPU with the device stubbed: the free memory it reports is a fixed total less the Adam moments
that exist right now, as a device's would be; the free bytes handed to the rule
(planning/output_layer.py output_chunk) are recorded per step."""
import pytest
import torch

from update_reference import policy_batch
from verl_hpc.config.schema import OptimConfig

TOTAL = 10 ** 12


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("free_models") / "llama", family="llama", layers=2)


def _engine(kind, folder):
    from verl_hpc.engines.options import default_options

    o = default_options(str(folder), engine=kind, optim=OptimConfig(lr=0.01), total_steps=4, micro_batch_size=3,
                        logits_chunk_tokens=None)
    if kind == "fsdp":
        from verl_hpc.engines.fsdp import FsdpEngine

        return FsdpEngine(o)
    from verl_hpc.engines.megatron import MegatronEngine
    from verl_hpc.parallel import init_model_parallel

    init_model_parallel(1, 1)
    return MegatronEngine(o)


def _moments(eng) -> int:
    opts = [eng.optimizer] if not hasattr(eng.optimizer, "chained_optimizers") else [
        w.optimizer for w in eng.optimizer.chained_optimizers]
    total = 0
    for opt in opts:
        for st in opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                t = st[key].to_local() if hasattr(st[key], "to_local") else st[key]
                total += t.numel() * t.element_size()
    return total


def nll(out, mb, counts):
    return -(out["log_probs"] * mb["response_mask"]).sum() / counts.tokens, {}


@pytest.mark.parametrize("kind", ["fsdp", "megatron"])
def test_step_one_reads_the_free_memory_of_later_steps(one_rank_world, llama, kind, monkeypatch):
    import verl_hpc.engines.fsdp.head as head_mod
    import verl_hpc.engines.logits as logits_mod
    import verl_hpc.planning.output_layer as ol

    box = {}
    fake = lambda device: TOTAL - (_moments(box["eng"]) if "eng" in box else 0)  # noqa: E731 (a device's)
    monkeypatch.setattr(head_mod, "device_free_bytes", fake)
    monkeypatch.setattr(logits_mod, "device_free_bytes", fake)
    seen, real = [], ol.output_chunk

    def spy(setting, vocab, tokens, act, free=None, want=None):
        seen.append(free)
        return real(setting, vocab, tokens, act, free, want)

    monkeypatch.setattr(ol, "output_chunk", spy)
    monkeypatch.setattr(head_mod, "output_chunk", spy)
    box["eng"] = eng = _engine(kind, llama)
    batch = policy_batch(6)
    per_step = []
    for _ in range(3):
        seen.clear()
        eng.train_step(batch, nll)
        per_step.append(sorted(set(seen)))
    assert _moments(eng) > 0 and per_step[0], per_step
    assert per_step[0] == per_step[1] == per_step[2] == [TOTAL - _moments(eng)], per_step
