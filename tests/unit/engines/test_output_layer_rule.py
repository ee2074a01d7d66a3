"""The output layer's rule on a device (planning/output_layer.py output_chunk): the whole logits
where they fit half the memory free at the output layer, else the fewest equal chunks that do; on
a CPU the fixed 256 MiB budget as before. On CPU with the device stubbed (its free memory given):
the chunk size for a given free memory, the whole logits when they fit, both engines' wiring
(the FSDP head, Megatron's scoring), the plan taking the same answer, and no host read inside the
chunk loops."""
import math

import pytest
import torch

from verl_hpc.planning import output_layer as ol

V = 151936
GB = 1e9


def test_cpu_keeps_the_fixed_budget():
    from verl_hpc.config.sections.model import logits_chunk_size

    chunk = logits_chunk_size(None, V)
    assert chunk == ol.cpu_chunk(V) == 432  # 256 MiB of fp32 logits at a Qwen vocabulary
    assert ol.output_chunk(None, V, 432, 4) == 0  # within one chunk: the whole logits
    assert ol.output_chunk(None, V, 433, 4) == 432
    assert ol.output_chunk(0, V, 10 ** 6, 2, free_bytes=1e15) == 0  # off: the whole logits always
    assert ol.output_chunk(96, V, 97, 2, free_bytes=1e15) == 96  # an explicit size holds on a device too
    with pytest.raises(ValueError, match="logits_chunk_tokens = -1"):
        ol.output_chunk(-1, V, 10, 2)


def test_whole_logits_where_they_fit_half_the_free_memory():
    tokens = 2 * 4096
    whole = ol.whole_logits_bytes(tokens, V)
    assert whole == tokens * V * ol.WHOLE_BYTES_PER_LOGIT
    assert ol.output_chunk(None, V, tokens, 2, free_bytes=2 * whole) == 0
    assert ol.output_chunk(None, V, tokens, 2, free_bytes=2 * whole - 1) > 0
    # V = 32,000, 8 x 2,048 tokens (the benchmark's shape) with 40 GB free: no chunks
    assert ol.output_chunk(None, 32000, 8 * 2048, 2, free_bytes=40 * GB) == 0


@pytest.mark.parametrize("free_gb", [4, 20, 60, 100])
def test_chunk_size_for_a_given_free_memory(free_gb):
    """8 x 4,096 tokens at V = 151,936 in bf16 (the whole logits: 30 B x 5e9 = 149 GB, more than a
    141 GB board): the fewest equal chunks whose working set fits half the free memory, each a
    multiple of 256 tokens."""
    tokens, free = 8 * 4096, free_gb * GB
    chunk = ol.output_chunk(None, V, tokens, 2, free_bytes=free)
    budget = ol.DEVICE_SHARE * free
    assert chunk > 0 and chunk % ol.CHUNK_ALIGN == 0
    assert ol.chunk_working_bytes(chunk, V, 2) + ol.CHUNK_TOKEN_BYTES * tokens <= budget
    largest = (budget - ol.CHUNK_TOKEN_BYTES * tokens) // ol.chunk_working_bytes(1, V, 2)
    fewest = math.ceil(tokens / (largest // ol.CHUNK_ALIGN * ol.CHUNK_ALIGN))
    assert math.ceil(tokens / chunk) == fewest  # no more chunks than the memory asks for
    assert math.ceil(tokens / chunk) < math.ceil(tokens / ol.cpu_chunk(V)) / 5 or free_gb < 10  # CPU budget: 76
    if free_gb == 20:  # 10 GB for the output layer: 14 B per logit in a chunk -> 4,608 tokens at most
        assert chunk == 4096


def test_more_free_memory_never_means_more_chunks():
    tokens = 8 * 4096
    counts = [math.ceil(tokens / ol.output_chunk(None, V, tokens, 2, free_bytes=f * GB)) for f in range(2, 150, 7)]
    assert counts == sorted(counts, reverse=True) and counts[-1] <= 2


def test_hardly_any_memory_gives_the_smallest_chunk_not_an_error():
    assert ol.output_chunk(None, V, 8 * 4096, 2, free_bytes=0) == ol.MIN_CHUNK
    assert ol.output_chunk(None, V, 8 * 4096, 2, free_bytes=-5 * GB) == ol.MIN_CHUNK


class LiveBytes:
    """The peak of live tensor storages while it is open (a dispatch mode: every op's outputs are
    counted until their storage is freed), the same on any CPU model."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        outer._add(t.untyped_storage())
                return out

        self.mode, self.live, self.now, self.peak = Mode(), {}, 0, 0

    def _add(self, storage):
        import weakref

        key, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or key in self.live:
            return
        self.live[key] = n
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._drop, key)

    def _drop(self, key):
        self.now -= self.live.pop(key, 0)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("want", [("log_probs",), ("log_probs", "entropy")])
def test_the_rule_charges_what_the_whole_logits_update_holds(dtype, want):
    """The peak bytes per logit of one forward + backward of the whole logits (engines/logits.py
    whole_outputs, as the engines' whole path computes them), measured per loss kind, is what the
    rule charges, to within its 1 byte of slack: an update without an entropy term must not be
    charged the entropy's softmax and products (29 B), or it chunks 2.3x too early."""
    from verl_hpc.engines.logits import whole_outputs

    n, v, h = 512, 8192, 32
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (0.1 * torch.randn(v, h, generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    with LiveBytes() as live:
        out = whole_outputs(hidden, weight, targets, want)
        loss = out["log_probs"].sum() + (0.01 * out["entropy"].sum() if "entropy" in want else 0.0)
        loss.backward()
        del out, loss
    grads = v * h * weight.element_size() + n * h * hidden.element_size()  # not per logit
    measured = (live.peak - grads) / (n * v)
    charged = ol.bytes_per_logit(want)
    assert measured <= charged <= measured + 1.5, (want, dtype, measured, charged)


def test_an_update_without_entropy_keeps_the_whole_logits_longer():
    """8 x 2,048 tokens at V = 151,936 with 60 GB free at the output layer (30 GB its share): the
    log-probs alone (13 B a logit: 32 GB) just miss, with 70 GB they fit; with entropy (30 B: 75 GB)
    neither does. Unknown outputs (the planner) are charged as with entropy."""
    tokens = 8 * 2048
    assert ol.output_chunk(None, V, tokens, 2, free_bytes=70 * GB, want=("log_probs",)) == 0
    assert ol.output_chunk(None, V, tokens, 2, free_bytes=60 * GB, want=("log_probs",)) > 0
    assert ol.output_chunk(None, V, tokens, 2, free_bytes=70 * GB, want=("log_probs", "entropy")) > 0
    assert ol.output_chunk(None, V, tokens, 2, free_bytes=70 * GB) > 0
    assert ol.bytes_per_logit(("log_probs", "sum_pi_squared")) == ol.WHOLE_BYTES_PER_LOGIT


def test_fsdp_head_asks_the_rule_for_the_outputs_it_scores(device_free):
    """A log-probs-only update with room for 13 B a logit and not for 30: the whole logits; the same
    micro-batch with entropy: chunks."""
    from verl_hpc.engines.fsdp.head import ChunkedHead

    v, h, n, t = 50, 8, 3, 40
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, t, h, generator=g)
    targets = torch.randint(0, v, (n, t), generator=g)
    device_free["bytes"] = 2 * 20 * n * t * v  # 20 B a logit for the output layer
    head = ChunkedHead(_linear(v, h), chunk=ol.cpu_chunk(v), temperature=1.0, setting=None)
    _score(head, hidden, targets, ("log_probs",))
    assert head.last == "whole"
    _score(head, hidden, targets, ("log_probs", "entropy"))
    assert head.last != "whole" and head.last > 0


# ----------------------------------------------------------------------------- the FSDP head


def _linear(v=50, h=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        lin.weight.copy_(0.3 * torch.randn(v, h, generator=g))
    return lin


def _score(head, hidden, targets, want):
    n, t = targets.shape
    rows = torch.arange(n).unsqueeze(1)
    positions = torch.arange(t).expand(n, t)
    with head.scoring(rows, positions, targets, want):
        stacked = head.linear(hidden)
    return head.results((stacked,), want)


@pytest.fixture
def device_free(monkeypatch):
    """The device stubbed: `free["bytes"]` is what device_free_bytes reports for any tensor's device."""
    import verl_hpc.engines.fsdp.head as head_mod
    import verl_hpc.engines.logits as logits_mod
    import verl_hpc.engines.megatron.outputs as mo  # noqa: F401 (reads logits_mod's)

    free = {"bytes": None}
    fake = lambda device: free["bytes"]  # noqa: E731
    monkeypatch.setattr(head_mod, "device_free_bytes", fake)
    monkeypatch.setattr(logits_mod, "device_free_bytes", fake)
    return free


def test_fsdp_head_on_a_device_keeps_the_whole_logits_or_chunks_by_free_memory(device_free):
    """auto on a stubbed device: the head takes every micro-batch (even one within the CPU chunk),
    and scores it whole where the whole logits fit half the free memory, else in the rule's
    chunks; log-probs, entropy and both gradients equal in every case (fp32)."""
    from verl_hpc.engines.fsdp.head import ChunkedHead
    from verl_hpc.engines.logits import token_outputs

    v, h, n, t = 50, 8, 3, 40
    g = torch.Generator().manual_seed(1)
    hidden0 = torch.randn(n, t, h, generator=g)
    targets = torch.randint(0, v, (n, t), generator=g)
    want = ("log_probs", "entropy")

    def run(free):
        device_free["bytes"] = free
        lin = _linear(v, h)
        head = ChunkedHead(lin, chunk=ol.cpu_chunk(v), temperature=0.7, setting=None)
        hidden = hidden0.clone().requires_grad_()
        assert head.takes(5) is (free is not None)
        out = _score(head, hidden, targets, want)
        (out["log_probs"].sum() + 0.3 * out["entropy"].sum()).backward()
        return head.last, out, hidden.grad, lin.weight.grad

    tokens = n * t
    whole_needs = ol.whole_logits_bytes(tokens, v)
    last, out_w, gh_w, gw_w = run(2 * whole_needs)
    assert last == "whole"
    small = 2 * (ol.CHUNK_TOKEN_BYTES * tokens + ol.chunk_working_bytes(16, v, 4))
    last_c, out_c, gh_c, gw_c = run(small)
    expected = ol.output_chunk(None, v, tokens, 4, small)
    assert last_c == expected and 0 < expected < tokens
    ref = token_outputs(hidden0, _linear(v, h).weight, targets, want, temperature=0.7, chunk=7)
    for out in (out_w, out_c):
        for k in want:
            torch.testing.assert_close(out[k], ref[k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gh_w, gh_c, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw_w, gw_c, rtol=1e-5, atol=1e-6)
    # a CPU (nothing reported): the fixed budget; this micro-batch fits one chunk, so the engine's own path
    device_free["bytes"] = None
    assert ChunkedHead(_linear(v, h), chunk=ol.cpu_chunk(v), temperature=1.0, setting=None).takes(tokens) is False


def test_megatron_scoring_on_a_device_decides_per_micro_batch(one_rank_world, device_free):
    """Megatron's chunked scoring with auto on a stubbed device: every pass hands hidden states out
    (chunks_pass), and each micro-batch takes the whole logits (the padded vocabulary's rows -inf,
    lm_outputs) or the rule's chunks; equal results."""
    from types import SimpleNamespace

    from verl_hpc.engines.megatron import outputs as mo
    from verl_hpc.parallel import init_model_parallel

    init_model_parallel(1, 1)
    v_real, v_pad, h, b, t = 45, 48, 8, 2, 30
    g = torch.Generator().manual_seed(2)
    weight = 0.3 * torch.randn(v_pad, h, generator=g)
    hidden = torch.randn(b, t, h, generator=g)
    mb = {"_targets": torch.randint(0, v_real, (b, t), generator=g)}
    auto = mo.LogitsChunk.of(ol.cpu_chunk(v_pad), True)
    assert auto.auto and int(auto) == ol.cpu_chunk(v_pad) and not mo.LogitsChunk.of(0, True).auto
    fixed = mo.LogitsChunk.of(64, False)  # an explicit size: the CPU rule, 60 tokens within one chunk
    mbs = [SimpleNamespace(data=mb)]

    def head(chunk):
        return SimpleNamespace(chunk=chunk, weight=weight, real_columns=v_real, group=None, temperature=1.3,
                               vocab_start=0, last=None, pending=lambda: 0, free_read=None)

    device_free["bytes"] = 1e12
    assert mo.chunks_pass(auto, mbs) is True and mo.chunks_pass(fixed, mbs) is False
    want = ("log_probs", "entropy")
    hw = head(auto)
    whole = mo.lm_outputs_chunked(hidden, mb, want, hw, selected=True)
    assert hw.last == "whole"
    device_free["bytes"] = 2 * (ol.CHUNK_TOKEN_BYTES * b * t + ol.chunk_working_bytes(16, v_pad, 4))
    hc = head(auto)
    chunked = mo.lm_outputs_chunked(hidden, mb, want, hc, selected=True)
    assert isinstance(hc.last, int) and 0 < hc.last < b * t
    for k in want:
        torch.testing.assert_close(whole[k], chunked[k], rtol=1e-5, atol=1e-6)
    device_free["bytes"] = None  # a CPU: the fixed rule, 60 tokens within one chunk
    assert mo.chunks_pass(auto, mbs) is False


def test_chunks_pass_keeps_the_cpu_rule_with_an_explicit_size(device_free):
    from types import SimpleNamespace

    from verl_hpc.engines.megatron import outputs as mo

    mbs = [SimpleNamespace(data={"_targets": torch.zeros(2, 30, dtype=torch.long)})]
    device_free["bytes"] = 1e12
    assert mo.chunks_pass(mo.LogitsChunk.of(16, False), mbs) is True  # 60 > 16
    assert mo.chunks_pass(mo.LogitsChunk.of(64, False), mbs) is False


# ----------------------------------------------------------------------------- no host syncs


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that read a value to the host or size an output by the data (a device sync
    on a GPU): .item() / float() / bool() (aten._local_scalar_dense), nonzero, masked_select."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.SYNCING:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_the_chunk_loops_read_nothing_to_the_host():
    from verl_hpc.engines.logits import token_outputs

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(70, 8, generator=g).requires_grad_()
    weight = (0.3 * torch.randn(40, 8, generator=g)).requires_grad_()
    targets = torch.randint(0, 40, (70,), generator=g)
    with _HostReads() as mode:
        out = token_outputs(hidden, weight, targets, ("log_probs", "entropy", "sum_pi_squared"),
                            temperature=0.8, chunk=16)
        (out["log_probs"].sum() + out["entropy"].sum()).backward()
    assert mode.seen == [], f"host reads inside the chunked output layer: {mode.seen}"


# ----------------------------------------------------------------------------- the plan


def test_the_plan_asks_the_same_rule_with_what_its_row_leaves_free():
    """A GPU plan's logits term: with room the whole logits' term; on a small board the chunked
    term of the chunk output_chunk gives for the memory the rest of the row leaves free."""
    from verl_hpc.config import load_config
    from verl_hpc.models.config_mapping import padded_vocab_size
    from verl_hpc.planning.model_shape import known_arch
    from verl_hpc.planning.phases import plan_job
    from verl_hpc.planning.training import logits_bytes

    def plan(gb):
        cfg = load_config(None, ["model.path=llama-3.2-1b", "parallel.engine=megatron", "slurm.gpus_per_node=1",
                                 "slurm.tasks_per_node=1", "model.dtype=bfloat16", "data.max_prompt_length=128",
                                 "data.max_response_length=4096", "actor.micro_batch_size=2",
                                 "trainer.job=sft"])
        return cfg, plan_job(cfg, gpu_memory_gb=gb, allow_known=True)

    cfg, big = plan(141)
    arch = known_arch("llama-3.2-1b")
    tokens = 2 * (128 + 4096)
    vocab = padded_vocab_size(arch.vocab_size, 1)
    whole = logits_bytes(arch, tokens, 1, 2, "lm", vocab, 0)
    assert big.table["update_actor"]["logits"] == pytest.approx(whole)
    _, small = plan(24)
    got = small.table["update_actor"]["logits"]
    assert got < whole / 2
    row = small.table["update_actor"]
    from verl_hpc.planning import hardware

    rest = sum(v for k, v in row.items() if k not in ("overhead", "nccl", "logits"))
    free = 24 * hardware.GB - hardware.CUDA_CONTEXT_BYTES - row["nccl"] - (1 + hardware.FRAGMENTATION) * rest
    chunk = ol.output_chunk(None, vocab, tokens, 2, free)
    assert chunk > 0 and got == pytest.approx(logits_bytes(arch, tokens, 1, 2, "lm", vocab, chunk))


# ----------------------------------------------------------------------------- the fused chunk body


@pytest.mark.parametrize("temperature, dtype", [(1.0, torch.float32), (0.7, torch.float32), (0.7, torch.bfloat16)])
def test_the_fused_chunk_body_is_the_eager_arithmetic(monkeypatch, temperature, dtype):
    """token_outputs(fused=True) (logits_fused.py, run eagerly here: torch.compile's kernels are the
    GPU's to measure) against the eager chunk body: the three outputs and both gradients, with the
    entropy's and the log-probs' gradient terms, a temperature and bf16 weights; no host read."""
    from verl_hpc.engines import logits_fused
    from verl_hpc.engines.logits import token_outputs

    monkeypatch.setattr(logits_fused, "COMPILE", False)
    g = torch.Generator().manual_seed(4)
    h0 = torch.randn(45, 8, generator=g).to(dtype)
    w0 = (0.3 * torch.randn(40, 8, generator=g)).to(dtype)
    targets = torch.randint(0, 40, (45,), generator=g)
    want = ("log_probs", "entropy", "sum_pi_squared")

    def run(fused):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with _HostReads() as mode:
            out = token_outputs(h, w, targets, want, temperature=temperature, chunk=16, fused=fused)
            (out["log_probs"].sum() + 0.3 * out["entropy"].sum()).backward()
        assert mode.seen == []
        return out, h.grad, w.grad

    (eager, gh_e, gw_e), (fused, gh_f, gw_f) = run(False), run(True)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for k in want:
        torch.testing.assert_close(fused[k], eager[k], rtol=1e-5, atol=1e-6)  # fp32 sums of the same logits
    torch.testing.assert_close(gh_f, gh_e, **tol)
    torch.testing.assert_close(gw_f, gw_e, **tol)
    # log-probs alone (no entropy gradient term) and entropy alone
    h = h0.clone().requires_grad_()
    token_outputs(h, w0, targets, ("log_probs",), chunk=16, fused=True)["log_probs"].sum().backward()
    h2 = h0.clone().requires_grad_()
    token_outputs(h2, w0, targets, ("log_probs",), chunk=16)["log_probs"].sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, **tol)
